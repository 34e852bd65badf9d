#!/usr/bin/env python3
"""scripts/gpu-check's body (see that script and docs/real-gpu.md).

Runs a release gpu-agent on this node and says in one table what it found:
NVML's per-call costs, inventory, labels, status, the CDI spec, a `run`
under a grpcio kubelet stand-in (start -> Register, start -> first
ListAndWatch, Allocate, RSS, idle CPU), /metrics (during a short CUDA load
when PyTorch is there) and how the agent stopped. Everything printed also
goes to the output file.

It changes no GPU setting and no host file: the commands it runs on the
host's root only read (inventory, labels, status, `cdi generate` without
--write), and the agent's `run` gets a policy that turns off the driver,
runtime, CDI, labels and MIG stages and a host root of its own (the host's
parts bound read-only in a private mount namespace, or a copy of a fixture
host), so the kubelet it registers with is the stand-in, not the node's.
Standard library only; Python 3.8 or newer.
"""
import argparse
import datetime
import glob
import json
import os
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile

PROTO = "deviceplugin_v1beta1"
# The stages the run's policy must leave off: they write host files or GPU
# settings (checked with `policy check` before the agent starts).
MUST_BE_OFF = ("mig", "runtime", "cdi", "labels")
RUN_POLICY = """\
# gpu-check's policy for `gpu-agent run`: discovery, the device plugin,
# health, metrics and validation only. No driver, container runtime, CDI,
# labels or MIG work; no device-plugin sharing config (so no MPS and no
# compute-mode change).
spec:
  reconcileIntervalSeconds: 0
  driver:
    enabled: false
  toolkit:
    enabled: false
  cdi:
    enabled: false
  gfd:
    enabled: false
  migManager:
    enabled: false
  validator:
    enabled: true
    workload: false
  devicePlugin:
    enabled: true
  dcgmExporter:
    enabled: true
    listen: 127.0.0.1:{port}
"""
# Metrics reported from a scrape (GPU 0), with dcgm-exporter's names.
FIELDS = [
    ("DCGM_FI_DEV_GPU_UTIL", "util %"),
    ("DCGM_FI_DEV_POWER_USAGE", "power W"),
    ("DCGM_FI_DEV_GPU_TEMP", "temp C"),
    ("DCGM_FI_DEV_FB_USED", "FB used MiB"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor active"),
]


def mono():
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class Report:
    """Prints to stdout and to the output file; collects the summary rows."""

    def __init__(self, path):
        self.path = path
        self.file = open(path, "w")
        self.rows = []

    def say(self, text=""):
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()

    def section(self, title):
        self.say()
        self.say(f"== {title} ==")

    def row(self, check, result, value):
        self.rows.append((check, result, value))
        self.say(f"-> {check}: {result}: {value}")

    def table(self):
        self.section("summary")
        w = max(len(c) for c, _, _ in self.rows) if self.rows else 10
        self.say(f"{'check':<{w}}  {'result':<7}  value")
        for check, result, value in self.rows:
            self.say(f"{check:<{w}}  {result:<7}  {value}")

    def failed(self):
        return [c for c, r, _ in self.rows if r == "FAILED"]


class Check:
    def __init__(self, args, report):
        self.a = args
        self.r = report
        self.tmp = tempfile.mkdtemp(prefix="gpu-check-")
        self.env = dict(os.environ)
        # The check is about this host: no simulated node, and what gpu-check
        # passes wins over the caller's environment.
        for k in ("GPU_AGENT_SIMULATE", "GPU_AGENT_HOST_ROOT", "GPU_AGENT_POLICY",
                  "GPU_AGENT_NVML_LIB", "GPU_AGENT_LOG_FORMAT", "DCGM_EXPORTER_LISTEN"):
            self.env.pop(k, None)
        self.inventory = None
        self.failed_stages = []

    # --- helpers ---------------------------------------------------------

    def agent_cmd(self, root, *args, policy=None, log_format="text"):
        cmd = [self.a.binary, "--host-root", root, "--log-format", log_format]
        if self.a.nvml_lib:
            cmd += ["--nvml-lib", self.a.nvml_lib]
        if policy:
            cmd += ["--policy", policy]
        return cmd + list(args)

    def agent(self, *args, root=None, policy=None, timeout=120):
        """Runs one gpu-agent command: (rc, stdout, stderr, ms)."""
        cmd = self.agent_cmd(root or self.a.host_root, *args, policy=policy)
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, "", f"timed out after {timeout} s: {' '.join(cmd)}", timeout * 1e3
        ms = (time.perf_counter() - t) * 1e3
        return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"), ms

    def step(self, name, fn):
        try:
            fn()
        except Exception as e:  # a broken step is a row, not the end of the check
            self.r.row(name, "FAILED", f"gpu-check itself failed here: {type(e).__name__}: {e}")

    # --- the steps -------------------------------------------------------

    def identity(self):
        self.r.section("host")
        rc, out, err, _ = self.agent("--version", root="/")
        version = out.strip() or err.strip()
        self.r.say(f"binary:     {self.a.binary} ({version})")
        self.r.say(f"host root:  {self.a.host_root}")
        self.r.say(f"NVML:       {self.a.nvml_lib or 'the host libnvidia-ml.so.1'}")
        self.r.say(f"host:       {socket.gethostname()}, kernel {platform.release()}, {platform.machine()}")
        self.r.say(f"as:         uid {os.getuid()}")
        self.r.say(f"started:    {time.strftime('%Y-%m-%d %H:%M:%S %z')}")
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                p = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
                for line in p.stdout.decode(errors="replace").splitlines():
                    self.r.say(f"nvidia-smi: {line}")
            except (OSError, subprocess.TimeoutExpired) as e:
                self.r.say(f"nvidia-smi: {e}")
        if rc != 0:
            self.r.row("binary", "FAILED", f"{self.a.binary} --version: exit {rc}: {err.strip()}")
        else:
            self.r.row("binary", "ok", version)

    def nvml_costs(self):
        self.r.section("NVML per-call costs (ctypes, no pynvml)")
        lib = self.a.nvml_lib or "libnvidia-ml.so.1"
        cmd = [sys.executable, os.path.join(self.a.helpers, "nvml_costs.py"), "--lib", lib,
               "--calls", str(self.a.calls)]
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, timeout=300)
        except subprocess.TimeoutExpired:
            self.r.row("NVML costs", "FAILED", "timed out after 300 s")
            return
        out = p.stdout.decode(errors="replace")
        first, _, table = out.partition("\n")
        try:
            summary = json.loads(first)
        except ValueError:
            summary = {"error": f"exit {p.returncode}: {first} {p.stderr.decode(errors='replace').strip()}"}
        if "error" in summary:
            hint = "" if self.a.nvml_lib else " (name the library with --nvml-lib PATH)"
            self.r.row("NVML costs", "FAILED", summary["error"] + hint)
            return
        for line in table.rstrip("\n").splitlines():
            self.r.say(line)
        with open(self.a.costs_out, "w") as f:
            f.write(table)
        slow = []
        for line in table.splitlines():
            parts = line.split()
            if "p50" in parts and not line.startswith("#"):
                i = parts.index("p50")
                slow.append((float(parts[i + 1]), " ".join(parts[:i])))
        slow.sort(reverse=True)
        slowest = ", ".join(f"{n} {v:.0f} us" for v, n in slow[:3])
        missing = f", {len(summary['missing'])} not exported" if summary["missing"] else ""
        self.r.row("NVML costs", "ok",
                   f"{summary['lines']} calls timed{missing}; nvmlInit {summary['init_first_ms']:.1f} ms first, "
                   f"{summary['init_again_ms']:.1f} ms again; slowest p50: {slowest}")
        self.r.say(f"(table written to {self.a.costs_out})")

    def inventory_step(self):
        self.r.section("gpu-agent inventory")
        rc, out, err, ms = self.agent("inventory")
        self.r.say(out.rstrip())
        if err.strip():
            self.r.say(err.rstrip())
        rc2, js, err2, ms2 = self.agent("inventory", "-o", "json")
        if rc != 0 or rc2 != 0:
            self.r.row("inventory", "FAILED", f"exit {rc or rc2}: {(err or err2).strip()[-300:]}")
            return
        inv = json.loads(js)
        self.inventory = inv
        gpus = inv.get("gpus", [])
        models = {}
        for g in gpus:
            models[g.get("model")] = models.get(g.get("model"), 0) + 1
        what = ", ".join(f"{n}x {m}" for m, n in models.items()) or "none"
        driver = (inv.get("driver") or {}).get("version") or "none loaded"
        warnings = inv.get("warnings") or []
        value = f"{len(gpus)} GPU(s): {what}; driver {driver}; {len(warnings)} warning(s); {min(ms, ms2):.0f} ms"
        self.r.row("inventory", "ok" if gpus else "FAILED", value if gpus else f"no GPU found; {value}")

    def labels_step(self):
        self.r.section("gpu-agent labels")
        rc, out, err, ms = self.agent("labels", "-o", "json")
        if rc != 0:
            self.r.row("labels", "FAILED", f"exit {rc}: {err.strip()[-300:]}")
            return
        labels = json.loads(out)
        for k in sorted(labels):
            self.r.say(f"{k}={labels[k]}")
        product = labels.get("nvidia.com/gpu.product", "?")
        self.r.row("labels", "ok" if labels else "FAILED",
                   f"{len(labels)} label(s); gpu.product={product}; {ms:.0f} ms")

    def status_step(self):
        self.r.section("gpu-agent status (this host, as it is)")
        rc, out, err, ms = self.agent("status", "-o", "json")
        try:
            st = json.loads(out)
        except ValueError:
            self.r.row("status", "FAILED", f"exit {rc}: {err.strip()[-300:]}")
            return
        self.r.say(f"source: {st.get('source')}: {st.get('note', '')}")
        states = self.print_stages(st)
        value = f"{st.get('source')}: " + ", ".join(f"{s} {state}" for s, state in states)
        if self.failed_stages:
            value += "; failed: " + "; ".join(self.failed_stages)
        self.r.row("status", "FAILED" if self.failed_stages else "ok", value)

    def print_stages(self, st):
        """Prints each stage; returns [(stage, state)] and keeps the failed ones' details."""
        states = []
        self.failed_stages = []
        for s in st.get("stages", []):
            states.append((s["stage"], s["state"]))
            if s["state"] == "failed":
                self.failed_stages.append(f"{s['stage']}: {s.get('detail', '')[:200]}")
            self.r.say(f"  {s['stage']:<9} {s['state']:<16} {s.get('detail', '')}")
            for c in s.get("changed") or []:
                self.r.say(f"  {'':<9} {'':<16} changed: {c}")
        return states

    def cdi_step(self):
        self.r.section("gpu-agent cdi generate (printed, not written)")
        rc, out, err, ms = self.agent("cdi", "generate")
        for line in err.splitlines():
            if line.startswith("note:") or "ERROR" in line or "WARN" in line:
                self.r.say(line)
        if rc != 0:
            self.r.row("cdi generate", "FAILED", f"exit {rc}: {err.strip()[-300:]}")
            return
        spec = json.loads(out)
        with open(self.a.cdi_out, "w") as f:
            f.write(out)
        devices = spec.get("devices", [])
        edits = spec.get("containerEdits", {})
        mounts = edits.get("mounts", [])
        libs = [m for m in mounts if ".so" in os.path.basename(m.get("hostPath", ""))]
        hooks = edits.get("hooks", [])
        nodes = edits.get("deviceNodes", [])
        self.r.say(f"kind {spec.get('kind')}, {len(devices)} device(s): "
                   + ", ".join(d["name"] for d in devices[:12]) + (" ..." if len(devices) > 12 else ""))
        self.r.say(f"common edits: {len(nodes)} device node(s), {len(mounts)} mount(s) ({len(libs)} libraries), "
                   f"{len(hooks)} hook(s)")
        for h in hooks:
            self.r.say(f"  hook {h.get('hookName')}: {' '.join(h.get('args', []))}")
        self.r.say(f"(spec written to {self.a.cdi_out})")
        value = (f"{len(devices)} device(s), {len(libs)} libraries, {len(mounts) - len(libs)} other mounts, "
                 f"{len(hooks)} hook(s), {len(nodes)} control node(s)")
        if not devices:
            said = [line for line in err.splitlines() if line.strip()]
            value = f"no device in the spec; {value}" + (f"; {said[0].strip()[:200]}" if said else "")
        self.r.row("cdi generate", "ok" if devices else "FAILED", value)

    # --- the run under the kubelet stand-in --------------------------------

    def grpc_env(self):
        """(python, env, stubs dir) for the stand-in, or raises Skip saying what is missing."""
        env = dict(self.env)
        if self.a.bundle:
            tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
            arch = platform.machine()
            wheels = sorted(glob.glob(os.path.join(self.a.home, "wheels", "*.whl")))

            def pick(prefix, ok):
                for w in wheels:
                    name = os.path.basename(w)
                    if name.startswith(prefix) and ok(name):
                        return w
                return None

            grpcio = pick("grpcio-", lambda n: f"-{tag}-{tag}-" in n and arch in n)

            def protobuf_ok(n):
                if "py3-none-any" in n:
                    return True
                if arch not in n:
                    return False
                parts = n.split("-")
                return len(parts) > 3 and parts[3] == "abi3" and parts[2] <= tag and len(parts[2]) <= len(tag)

            proto = pick("protobuf-", protobuf_ok)
            typing_ext = pick("typing_extensions-", lambda n: True)
            if not grpcio or not proto:
                have = ", ".join(os.path.basename(w) for w in wheels) or "none"
                raise Skip(f"no grpcio/protobuf wheel for {tag} on {arch} in {self.a.home}/wheels (have: {have}); "
                           f"make the bundle with --pythons {sys.version_info[0]}.{sys.version_info[1]} "
                           f"(and --arch {arch})")
            site = os.path.join(self.a.home, "site", f"{tag}-{arch}")
            if not os.access(self.a.home, os.W_OK):
                site = os.path.join(self.tmp, "site")
            marker = os.path.join(site, ".unpacked")
            picked = [w for w in (grpcio, proto, typing_ext) if w]
            if not os.path.exists(marker) or open(marker).read() != "\n".join(picked):
                shutil.rmtree(site, ignore_errors=True)
                os.makedirs(site)
                for w in picked:
                    with zipfile.ZipFile(w) as z:
                        z.extractall(site)
                with open(marker, "w") as f:
                    f.write("\n".join(picked))
            env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
            python = sys.executable
            stubs = os.path.join(self.a.home, "stubs")
        else:
            python = self.a.python
            if not python or not os.path.exists(python):
                raise Skip(f"no Python with grpcio at {python or 'target/pyvenv/bin/python'}: make it with "
                           "`python3 -m venv target/pyvenv && target/pyvenv/bin/pip install grpcio==1.85.1 "
                           "grpcio-tools==1.85.1` (scripts/test does), or give --python, or use a bundle")
            stubs = os.path.join(self.tmp, "stubs")
            proto = os.path.join(self.a.home, "..", "proto", "proto", f"{PROTO}.proto")
            p = subprocess.run([python, os.path.join(self.a.helpers, "gen_stubs.py"), stubs, proto],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=120)
            if p.returncode != 0:
                raise Skip(p.stdout.decode(errors="replace").strip())
        p = subprocess.run([python, "-c", "import grpc; print(grpc.__version__)"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, env=env, timeout=120)
        if p.returncode != 0:
            raise Skip(f"{python} cannot import grpc: {p.stdout.decode(errors='replace').strip()[-300:]}")
        self.r.say(f"kubelet stand-in: {python}, grpcio {p.stdout.decode().strip()}, stubs in {stubs}")
        return python, env, stubs

    def sandbox(self):
        """How the agent gets a host root of its own: (mode, root, src, wrapper argv)."""
        root = os.path.join(self.tmp, "root")
        mode = self.a.sandbox
        if mode == "auto":
            mode = "bind" if os.path.realpath(self.a.host_root) == "/" else "copy"
        os.makedirs(root)
        if mode == "copy":
            p = subprocess.run(["cp", "-a", os.path.join(self.a.host_root, "."), root + "/"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if p.returncode != 0:
                raise Skip(f"cannot copy {self.a.host_root} to {root}: {p.stdout.decode(errors='replace')}")
            return "copy", root, []
        unshare = shutil.which("unshare")
        if not unshare or not shutil.which("mount"):
            raise Skip("`unshare` and `mount` (util-linux) are needed for the agent's private host root")
        if os.getuid() == 0:
            wrap = [unshare, "--mount", "--propagation", "private"]
        else:
            wrap = [unshare, "--user", "--map-root-user", "--mount", "--propagation", "private"]
            self.env["GPU_CHECK_USERNS"] = "1"
        probe = subprocess.run(wrap + ["true"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if probe.returncode != 0:
            raise Skip("a private mount namespace is needed so that the agent's writes stay in a temp host root: "
                       f"{' '.join(wrap)} true: {probe.stdout.decode(errors='replace').strip()} "
                       "(run gpu-check as root)")
        return "bind", root, wrap

    def run_step(self):
        self.r.section("gpu-agent run under the grpcio kubelet stand-in")
        try:
            python, genv, stubs = self.grpc_env()
            mode, root, wrap = self.sandbox()
        except Skip as s:
            self.r.row("run", "skipped", str(s))
            return
        port = free_port()
        policy = os.path.join(self.tmp, "policy.yaml")
        with open(policy, "w") as f:
            f.write(RUN_POLICY.replace("{port}", str(port)))
        rc, out, err, _ = self.agent("policy", "check", policy, root=root)
        on = [line.split()[0] for line in out.splitlines()[2:] if line.split()[1:2] == ["on"]]
        if rc != 0 or any(s in on for s in MUST_BE_OFF):
            self.r.row("run", "FAILED", f"refusing to start the agent: its policy check says {out.strip()} {err.strip()}")
            return
        self.r.say(f"host root: {root} ({'host parts bound read-only, private mount namespace' if mode == 'bind' else 'a copy of ' + self.a.host_root})")
        self.r.say(f"stages on: {', '.join(on)}")
        plugin_dir = os.path.join(root, "var/lib/kubelet/device-plugins")
        os.makedirs(plugin_dir, exist_ok=True)
        standin = subprocess.Popen(
            [python, os.path.join(self.a.helpers, "kubelet_timed.py"), "--stubs", stubs, "--dir", plugin_dir,
             "--allocations", str(self.a.allocations)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=genv)
        events = queue.Queue()
        seen = []
        threading.Thread(target=read_lines, args=(standin.stdout, events, seen), daemon=True).start()
        standin_err = []
        threading.Thread(target=read_lines, args=(standin.stderr, None, standin_err), daemon=True).start()
        agent = None
        try:
            ev = wait_event(events, lambda e: e.get("event") == "listening", 120)
            if ev is None:
                self.r.row("run", "FAILED", "the kubelet stand-in did not listen: " + " ".join(standin_err)[-500:])
                return
            regs, lists, allocs = [], [], []
            for n in range(1, self.a.starts + 1):
                agent, t0 = self.start_agent(mode, root, wrap, policy, n)
                if agent is None:
                    return
                def gone(p=agent):
                    return p.poll() is not None

                got = []
                for kind in ("registered", "list", "allocated"):
                    got.append(wait_event(events, lambda e, k=kind: e.get("n") == n and e.get("event") in (k, "error"),
                                          60, gone))
                    if got[-1] is None or got[-1].get("event") == "error":
                        break
                reg, lst, alloc = (got + [None, None])[:3]
                bad = [e for e in got if e is None or e.get("event") == "error"]
                if bad:
                    why = bad[0] or ("the agent exited (code %s) before the stand-in saw it %s" % (agent.poll(), kind)
                                     if agent.poll() is not None else f"no {kind} within 60 s")
                    self.r.row("run", "FAILED", f"start {n}: {why} (agent log: {self.a.log_out})")
                    self.r.say(tail(self.a.log_out, 30))
                    return
                regs.append((reg["at"] - t0) * 1e3)
                lists.append((lst["t"] - t0) * 1e3)
                allocs.append(alloc)
                self.r.say(f"start {n}: start -> Register {regs[-1]:.1f} ms, start -> first ListAndWatch "
                           f"{lists[-1]:.1f} ms ({lst['devices']} device(s), {lst['healthy']} healthy), "
                           f"Allocate p50 {alloc['p50_ms']:.2f} ms over {alloc['calls']} calls")
                if n < self.a.starts:
                    code, ms = stop(agent)
                    agent = None
                    self.r.say(f"start {n}: stopped by SIGTERM: exit {code} in {ms:.0f} ms")
            self.r.row("run: start -> Register", "ok", spread(regs) + f" ({len(regs)} start(s), {self.where()})")
            self.r.row("run: start -> first ListAndWatch", "ok",
                       spread(lists) + f" ({lst['devices']} device(s) listed, {lst['healthy']} healthy)")
            p50s = [a["p50_ms"] for a in allocs]
            self.r.row("run: Allocate p50", "ok", spread(p50s, 2) + f" ({allocs[-1]['calls']} calls a start; "
                       f"max {max(a['max_ms'] for a in allocs):.2f} ms)")
            envs = allocs[-1].get("envs") or {}
            self.r.say(f"Allocate's envs: {envs}")
            self.live_agent(agent, root, port)
            code, ms = stop(agent)
            agent = None
            self.r.row("run: stop (SIGTERM)", "ok" if code == 0 else "FAILED", f"exit {code} in {ms:.0f} ms")
            self.agent_timeline()
            self.agent_log_findings()
        finally:
            if agent is not None:
                stop(agent)
            try:
                standin.stdin.close()
                standin.wait(timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                standin.kill()
            cleanup_root(root, mode)

    def where(self):
        if self.a.nvml_lib and ("fake" in os.path.realpath(self.a.nvml_lib) or "FAKE_NVML_NODE" in self.env):
            return f"fake NVML, FAKE_NVML_COSTS={self.env.get('FAKE_NVML_COSTS', 'on (default)')}"
        return "this host's NVML"

    def start_agent(self, mode, root, wrap, policy, n):
        cmd = wrap + ["sh", os.path.join(self.a.helpers, "sandbox.sh"),
                      "bind" if mode == "bind" else "none", root, self.a.host_root, self.a.log_out, "--"]
        cmd += self.agent_cmd(root, "run", policy=policy, log_format="json")
        with open(self.a.log_out, "a") as f:
            f.write(f"=== start {n}: {' '.join(cmd)}\n")
        err = open(os.path.join(self.tmp, f"sandbox-{n}.err"), "w+")
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=self.env)
        ready = p.stdout.readline().decode(errors="replace").strip()
        if ready != "ready":
            p.wait(timeout=30)
            err.seek(0)
            self.r.row("run", "FAILED", f"start {n}: the sandbox did not come up (exit {p.returncode}): "
                       f"{ready} {err.read().strip()}")
            return None, None
        t0 = mono()
        p.stdin.write(b"go\n")
        p.stdin.flush()
        if n == 1:
            err.seek(0)
            for line in err.read().splitlines():
                self.r.say(line)
        return p, t0

    def live_agent(self, agent, root, port):
        pid = agent.pid
        time.sleep(self.a.idle_seconds / 2)
        c0, t0 = cpu_seconds(pid), mono()
        time.sleep(self.a.idle_seconds)
        c1, t1 = cpu_seconds(pid), mono()
        rss = rss_mib(pid)
        self.r.row("run: RSS", "ok" if rss else "FAILED", f"{rss:.1f} MiB (listed and allocated, before any scrape)"
                   if rss else f"cannot read /proc/{pid}/status")
        if c0 is not None and c1 is not None:
            self.r.row("run: CPU while idle", "ok", f"{(c1 - c0) / (t1 - t0) * 100:.2f} % of a core over "
                       f"{t1 - t0:.1f} s ({(c1 - c0) * 1e3:.0f} ms of CPU)")
        rc, out, err, _ = self.agent("status", "-o", "json", root=root)
        try:
            st = json.loads(out)
            self.r.say(f"status of the running agent: {st.get('source')}: {st.get('note', '')}")
            states = self.print_stages(st)
            for pl in st.get("plugin") or []:
                self.r.say(f"  plugin {pl.get('resource')}: {pl.get('devices')} device(s), registered "
                           f"{pl.get('registered')}, registrations {pl.get('registrations')}, lists {pl.get('lists')}")
            value = (", ".join(f"{s} {state}" for s, state in states if state != "disabled")
                     + f"; off: {', '.join(s for s, state in states if state == 'disabled')}")
            if self.failed_stages:
                value += "; failed: " + "; ".join(self.failed_stages)
            self.r.row("run: stages", "FAILED" if self.failed_stages else "ok", value)
        except ValueError:
            self.r.row("run: stages", "FAILED", f"status -o json: exit {rc}: {err.strip()[-300:]}")
        self.metrics(pid, port)

    def metrics(self, pid, port):
        url = f"http://127.0.0.1:{port}/metrics"
        self.r.section(f"metrics ({url})")
        try:
            first, ms1 = scrape(url)
            time.sleep(1.2)
            second, ms2 = scrape(url)
        except OSError as e:
            self.r.row("metrics scrape", "FAILED", f"{url}: {e}")
            return
        series = [s for s in second if not s[0].startswith("gpu_agent_")]
        names = sorted({s[0] for s in series})
        own = sorted({s[0] for s in second if s[0].startswith("gpu_agent_")})
        self.r.say(f"{len(series)} series of {len(names)} DCGM field(s), {len(own)} gpu_agent_* metric(s)")
        self.r.say("fields: " + ", ".join(names))
        idle = gpu0(second)
        self.r.say("GPU 0 idle: " + ", ".join(f"{label} {idle[n]:g}" for n, label in FIELDS if n in idle))
        self.r.row("metrics scrape", "ok" if series else "FAILED",
                   f"{len(series)} series, {len(names)} fields; scrape {ms1:.1f} ms first, {ms2:.1f} ms next; "
                   f"RSS after {rss_mib(pid):.1f} MiB")
        self.load(url)

    def load(self, url):
        py = self.a.torch_python
        loader = os.path.join(self.a.helpers, "load.py")
        if self.a.load_seconds <= 0:
            self.r.row("metrics under CUDA load", "skipped", "--load-seconds 0")
            return
        env = dict(self.env)
        # CUDA's device 0 is then NVML's GPU 0, whose metrics are read.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        p = subprocess.Popen([py, loader, str(self.a.load_seconds)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        events = queue.Queue()
        threading.Thread(target=read_lines, args=(p.stdout, events, []), daemon=True).start()
        first = wait_event(events, lambda e: True, 300)
        if first is None or first.get("event") != "started":
            p.wait(timeout=60)
            why = (first or {}).get("why") or p.stderr.read().decode(errors="replace").strip()[-300:]
            self.r.row("metrics under CUDA load", "skipped", f"{py}: {why}")
            return
        peak = {}
        smi = []
        end = mono() + self.a.load_seconds + 60
        done = None
        while done is None and mono() < end:
            try:
                done = events.get(timeout=1.0)
            except queue.Empty:
                if p.poll() is not None:
                    break
            try:
                samples, _ = scrape(url)
            except OSError:
                continue
            for k, val in gpu0(samples).items():
                peak[k] = max(peak.get(k, val), val)
            if not smi and shutil.which("nvidia-smi"):
                q = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=utilization.gpu,power.draw,memory.used",
                                    "--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, timeout=30)
                smi.append(q.stdout.decode(errors="replace").strip())
        p.wait(timeout=60)
        if not done or done.get("event") != "done":
            self.r.row("metrics under CUDA load", "FAILED", f"the load did not finish: {done}")
            return
        self.r.say(f"load: {done['tflops']:.0f} TFLOP/s bf16 on {done['device']} for {done['seconds']:.1f} s")
        self.r.say("GPU 0 peak under load: " + ", ".join(f"{label} {peak[n]:g}" for n, label in FIELDS if n in peak))
        if smi:
            self.r.say(f"nvidia-smi during the load (util %, power W, memory MiB): {smi[0]}")
        value = (f"{done['tflops']:.0f} TFLOP/s; peak " + ", ".join(f"{label} {peak[n]:g}" for n, label in FIELDS
                                                                   if n in peak)
                 + (f"; nvidia-smi (util %, W, MiB) {smi[0]}" if smi else ""))
        util = peak.get("DCGM_FI_DEV_GPU_UTIL")
        if util is None or util < 50:
            value = f"the load ran but DCGM_FI_DEV_GPU_UTIL peaked at {util}; {value}"
        self.r.row("metrics under CUDA load", "ok" if util is not None and util >= 50 else "FAILED", value)

    def agent_timeline(self):
        """When the agent itself says each stage finished, it registered and
        it was ready, in ms after its own first log line, for every start."""
        starts = []
        try:
            with open(self.a.log_out, errors="replace") as f:
                for line in f:
                    if line.startswith("=== start "):
                        starts.append([])
                    elif starts:
                        try:
                            starts[-1].append(json.loads(line))
                        except ValueError:
                            pass
        except OSError:
            return
        per_start = []
        for n, events in enumerate(starts, 1):
            marks = {}
            t_first = None
            for e in events:
                try:
                    t = datetime.datetime.strptime(e["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ")
                except (KeyError, ValueError):
                    continue
                t_first = t_first or t
                f = e.get("fields") or {}
                msg = f.get("message", "")
                key = None
                if f.get("stage") and f.get("state") in ("done", "failed"):
                    key = f"{f['stage']} {f['state']}"
                elif msg.startswith("registered with the kubelet"):
                    key = "registered"
                elif msg.startswith("told systemd the agent is ready"):
                    key = "ready"
                if key and key not in marks:
                    marks[key] = (t - t_first).total_seconds() * 1e3
            if marks:
                per_start.append(marks)
                self.r.say(f"start {n}, the agent's log (ms after its first line): "
                           + ", ".join(f"{k} +{v:.1f}" for k, v in sorted(marks.items(), key=lambda kv: kv[1])))
        if not per_start:
            return
        keys = [k for k in ("discover done", "registered", "devnodes done", "validate done", "ready")
                if all(k in m for m in per_start)]
        if keys:
            med = {k: sorted(m[k] for m in per_start)[len(per_start) // 2] for k in keys}
            self.r.row("run: the agent's own timeline", "ok",
                       ", ".join(f"{k} +{med[k]:.1f}" for k in keys)
                       + f" ms after its first log line (median of {len(per_start)} start(s))")

    def agent_log_findings(self):
        """The agent's warnings and errors over every start, each said once."""
        seen = {}
        try:
            with open(self.a.log_out, errors="replace") as f:
                for line in f:
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    if e.get("level") not in ("WARN", "ERROR"):
                        continue
                    fields = dict(e.get("fields") or {})
                    msg = fields.pop("message", "")
                    text = f"{e['level']} {msg} " + " ".join(f"{k}={v}" for k, v in fields.items())
                    seen[text] = seen.get(text, 0) + 1
        except OSError:
            return
        self.r.say(f"agent log: {self.a.log_out}; {sum(seen.values())} warning/error line(s), "
                   f"{len(seen)} different")
        for text, n in list(seen.items())[:25]:
            self.r.say(f"  {text[:300]}" + (f" (x{n})" if n > 1 else ""))


class Skip(Exception):
    pass


def read_lines(stream, events, keep):
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        keep.append(line)
        if events is not None:
            try:
                events.put(json.loads(line))
            except ValueError:
                pass


def wait_event(events, match, timeout, gone=None):
    """The first event that matches (None after `timeout` seconds, or soon
    after `gone()` turns true); the others are put back in order."""
    end = mono() + timeout
    held = []
    found = None
    grace = None
    while found is None:
        left = end - mono()
        if left <= 0:
            break
        if gone is not None and grace is None and gone():
            # What the process said before it went may still be on its way.
            grace = mono() + 1.0
        if grace is not None and mono() > grace:
            break
        try:
            e = events.get(timeout=min(left, 0.1))
        except queue.Empty:
            continue
        if match(e):
            found = e
        else:
            held.append(e)
    rest = []
    while True:
        try:
            rest.append(events.get_nowait())
        except queue.Empty:
            break
    for e in held + rest:
        events.put(e)
    return found


def stop(p):
    t = time.perf_counter()
    try:
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        code = p.wait()
    return code, (time.perf_counter() - t) * 1e3


def spread(values, digits=1):
    lo, hi = min(values), max(values)
    s = sorted(values)
    if len(values) == 1:
        return f"{lo:.{digits}f} ms"
    return f"{lo:.{digits}f}-{hi:.{digits}f} ms (median {s[len(s) // 2]:.{digits}f})"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def scrape(url):
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = resp.read().decode(errors="replace")
    ms = (time.perf_counter() - t) * 1e3
    samples = []
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        try:
            samples.append((name, labels.rstrip("}"), float(value)))
        except ValueError:
            pass
    return samples, ms


def gpu0(samples):
    return {name: v for name, labels, v in samples if 'gpu="0"' in labels}


def tail(path, n):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def cleanup_root(root, mode):
    """Removes the run's host root. The bound parts were mounted in the
    agent's own mount namespace only, which is gone with it: here they are
    empty directories (rmdir, never a recursive delete)."""
    if not os.path.isdir(root):
        return
    if mode == "copy":
        shutil.rmtree(root, ignore_errors=True)
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name in ("run", "var") and not os.path.ismount(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.islink(path):
            os.unlink(path)
        else:
            try:
                os.rmdir(path)
            except OSError:
                pass
    try:
        os.rmdir(root)
    except OSError:
        pass


def fail(message):
    """Bad input: says what is missing, exits 2 (as gpu-agent does)."""
    print(f"gpu-check: error: {message}", file=sys.stderr)
    sys.exit(2)


def remove_tmp(tmp):
    """Removes gpu-check's temp dir, unless something is mounted under it
    in this mount namespace (the binds live in the agent's namespace only;
    a mount seen here is left alone, and named)."""
    mounted = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].replace("\\040", " ")
                if point == tmp or point.startswith(tmp + "/"):
                    mounted.append(point)
    except OSError:
        mounted.append("(cannot read /proc/self/mountinfo)")
    if mounted:
        print(f"gpu-check: leaving {tmp} in place: mounted under it: {', '.join(mounted)}", file=sys.stderr)
        return
    shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(
        prog="gpu-check",
        description="gpu-agent on this GPU node: NVML's per-call costs, inventory, labels, status, "
                    "cdi generate, `gpu-agent run` under a grpcio kubelet stand-in (start -> Register, "
                    "start -> first ListAndWatch, Allocate, RSS, idle CPU), /metrics during a short CUDA "
                    "load; one summary table, also written to a file. Changes no GPU setting and no host "
                    "file; run it as root.",
        epilog="`gpu-check bundle DIR [--binary PATH]` (in a checkout, with network) makes a directory "
               "that runs this with no network. See docs/real-gpu.md.")
    ap.add_argument("--home", required=True, help=argparse.SUPPRESS)
    ap.add_argument("--binary", default=os.environ.get("GPU_CHECK_BINARY"),
                    help="the gpu-agent release binary (default: gpu-agent beside gpu-check in a bundle, "
                         "target/release/gpu-agent in a checkout; env GPU_CHECK_BINARY)")
    ap.add_argument("--host-root", default=os.environ.get("GPU_CHECK_HOST_ROOT", "/"),
                    help="the host's / (default /; a fixture host for a test; env GPU_CHECK_HOST_ROOT)")
    ap.add_argument("--nvml-lib", default=os.environ.get("GPU_CHECK_NVML_LIB"),
                    help="the NVML library (default: the host's libnvidia-ml.so.1; env GPU_CHECK_NVML_LIB)")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT"),
                    help="the output file (default gpu-check-<host>-<time>.txt here; env GPU_CHECK_OUT); "
                         "beside it: <out>-nvml-costs.txt, <out>-cdi.json, <out>-agent.log")
    ap.add_argument("--python", default=os.environ.get("GPU_CHECK_PYTHON"),
                    help="a checkout's Python with grpcio and grpcio-tools (default target/pyvenv/bin/python; "
                         "a bundle brings its own wheels; env GPU_CHECK_PYTHON)")
    ap.add_argument("--torch-python", default=os.environ.get("GPU_CHECK_TORCH_PYTHON", "python3"),
                    help="the Python that imports torch for the CUDA load (default python3; "
                         "env GPU_CHECK_TORCH_PYTHON)")
    ap.add_argument("--sandbox", choices=["auto", "bind", "copy"], default="auto",
                    help="the run's host root: bind (the host's parts read-only in a private mount namespace; "
                         "auto for host root /) or copy (a copy of --host-root; auto otherwise)")
    ap.add_argument("--starts", type=int, default=3, help="agent starts timed (default 3)")
    ap.add_argument("--allocations", type=int, default=50, help="Allocate calls timed a start (default 50)")
    ap.add_argument("--calls", type=int, default=20, help="calls timed per NVML function (default 20)")
    ap.add_argument("--idle-seconds", type=float, default=5, help="idle CPU measured over this long (default 5)")
    ap.add_argument("--load-seconds", type=float, default=15, help="CUDA load length; 0 skips it (default 15)")
    a = ap.parse_args()
    a.helpers = os.path.join(a.home, "gpu-check.d")
    a.bundle = os.path.isdir(os.path.join(a.home, "wheels")) and os.path.isdir(os.path.join(a.home, "stubs"))
    if not a.binary:
        a.binary = os.path.join(a.home, "gpu-agent") if a.bundle else \
            os.path.normpath(os.path.join(a.home, "..", "target", "release", "gpu-agent"))
    if not (os.path.isfile(a.binary) and os.access(a.binary, os.X_OK)):
        fail(f"no gpu-agent binary at {a.binary}: build one with `cargo build --release -p gpu-agent` "
                 "or name it with --binary PATH (GPU_CHECK_BINARY)")
    a.binary = os.path.abspath(a.binary)
    if not os.path.isdir(a.host_root):
        fail(f"host root {a.host_root} is not a directory")
    a.host_root = os.path.abspath(a.host_root)
    if a.nvml_lib:
        if not os.path.exists(a.nvml_lib):
            fail(f"NVML library {a.nvml_lib} does not exist")
        a.nvml_lib = os.path.abspath(a.nvml_lib)
    if not a.bundle and not a.python:
        a.python = os.path.normpath(os.path.join(a.home, "..", "target", "pyvenv", "bin", "python"))
    if a.starts < 1:
        fail("--starts must be at least 1")
    if not a.out:
        a.out = f"gpu-check-{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    a.out = os.path.abspath(a.out)
    base = a.out[:-4] if a.out.endswith(".txt") else a.out
    a.costs_out, a.cdi_out, a.log_out = base + "-nvml-costs.txt", base + "-cdi.json", base + "-agent.log"
    open(a.log_out, "w").close()
    report = Report(a.out)
    check = Check(a, report)
    report.say("gpu-check: gpu-agent on a real node (changes no GPU setting, writes no host file)")
    try:
        check.step("binary", check.identity)
        # First, while the GPU is idle and nothing else of ours holds NVML.
        check.step("NVML costs", check.nvml_costs)
        check.step("inventory", check.inventory_step)
        check.step("labels", check.labels_step)
        check.step("status", check.status_step)
        check.step("cdi generate", check.cdi_step)
        check.step("run", check.run_step)
    finally:
        remove_tmp(check.tmp)
    report.table()
    report.say()
    report.say(f"written to {a.out} (also {os.path.basename(a.costs_out)}, {os.path.basename(a.cdi_out)}, "
               f"{os.path.basename(a.log_out)} beside it)")
    failed = report.failed()
    if failed:
        report.say(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

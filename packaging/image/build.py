#!/usr/bin/env python3
"""Writes gpu-agent's container image as an OCI image layout and an OCI
archive (a tar of that layout), with no container engine and nothing but
Python's standard library (and dpkg-query, for the runtime's versions).

The image is one gzip layer: the two binaries, dynamically linked against
glibc, and the minimal glibc runtime they and a dlopened libnvidia-ml need,
taken from the build machine's Debian packages (libc6, libgcc-s1):

    /usr/bin/gpu-agent                          0755  (the entrypoint)
    /usr/bin/gpu-controller                     0755
    /lib64/ld-linux-x86-64.so.2                 -> /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2  (libc6: the dynamic loader)
    /lib/x86_64-linux-gnu/libc.so.6, libm.so.6  (libc6)
    /lib/x86_64-linux-gnu/libpthread.so.0, libdl.so.2, librt.so.1
                                                (libc6: stubs since glibc 2.34,
                                                 named by libnvidia-ml)
    /lib/x86_64-linux-gnu/libgcc_s.so.1         (libgcc-s1)
    /usr/share/doc/libc6/copyright, /usr/share/doc/libgcc-s1/copyright
    /usr/share/doc/gpu-agent/runtime-packages   (the packages and versions)
    /tmp                                        1777  (empty; a mount point)

Each binary must be an ELF whose interpreter (PT_INTERP) and every needed
library (DT_NEEDED) are in the image; one that is not is refused, naming
what is missing. The output is the same bytes on every run for the same
inputs: entries sorted, owners 0:0 with no names, every mtime the one given
(SOURCE_DATE_EPOCH, default 0), gzip without a name or a time.

usage: build.py --agent BIN --controller BIN --version V --ref NAME --out DIR
                [--sysroot DIR]
Writes DIR/oci/ (the layout) and DIR/<archive> (default gpu-agent-V.oci.tar).
--sysroot (default /) is the Debian system the runtime's files and versions
are taken from.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import time

PT_LOAD = 1
PT_DYNAMIC = 2
PT_INTERP = 3
DT_NULL = 0
DT_NEEDED = 1
DT_STRTAB = 5
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"

# The glibc runtime per architecture: the Debian multiarch triplet, the
# loader's file name and the PT_INTERP path that names it (a symlink in
# libc6), the libraries taken from libc6 and from libgcc-s1.
RUNTIME = {
    "amd64": {"triplet": "x86_64-linux-gnu", "loader": "ld-linux-x86-64.so.2", "interp": "/lib64/ld-linux-x86-64.so.2"},
    "arm64": {"triplet": "aarch64-linux-gnu", "loader": "ld-linux-aarch64.so.1", "interp": "/lib/ld-linux-aarch64.so.1"},
}
# libc.so.6 and libm.so.6 (the binaries need them); libpthread, libdl and
# librt: stubs in glibc 2.34 and later, kept because libnvidia-ml.so (built
# against older glibc) names them in its DT_NEEDED.
LIBC6_LIBS = ["libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"]
LIBGCC_LIBS = ["libgcc_s.so.1"]
# Where the loader looks with no ld.so.cache (Debian's glibc: `ld.so --help`).
SEARCH_DIRS = ["lib/{t}", "usr/lib/{t}", "lib", "usr/lib"]


class BuildError(Exception):
    pass


class Symlink:
    def __init__(self, target):
        self.target = target


def elf_facts(path, data):
    """(machine, PT_INTERP or None, [DT_NEEDED]) of a 64-bit little-endian
    ELF. Raises BuildError when `data` is not one."""
    if data[:4] != b"\x7fELF":
        raise BuildError(f"{path}: not an ELF executable")
    if data[4] != 2 or data[5] != 1:
        raise BuildError(f"{path}: not a 64-bit little-endian ELF")
    (e_machine,) = struct.unpack_from("<H", data, 0x12)
    (e_phoff,) = struct.unpack_from("<Q", data, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    interp, dynamic, loads = None, None, []
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        p_type, _flags, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from("<IIQQQQ", data, off)
        if p_type == PT_INTERP:
            interp = data[p_offset : p_offset + p_filesz].rstrip(b"\0").decode(errors="replace")
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
        elif p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
    needed = []
    if dynamic is not None:
        strtab, offsets = None, []
        for off in range(dynamic[0], dynamic[0] + dynamic[1] - 15, 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == DT_NULL:
                break
            if tag == DT_STRTAB:
                strtab = val
            elif tag == DT_NEEDED:
                offsets.append(val)
        if offsets:
            # DT_STRTAB is an address: the file offset is in its PT_LOAD.
            base = next((o + strtab - v for v, o, n in loads if v <= strtab < v + n), None)
            if base is None:
                raise BuildError(f"{path}: DT_STRTAB {strtab:#x} is in no PT_LOAD segment")
            for o in offsets:
                end = data.index(b"\0", base + o)
                needed.append(data[base + o : end].decode(errors="replace"))
    machine = {0x3E: "amd64", 0xB7: "arm64"}.get(e_machine)
    if machine is None:
        raise BuildError(f"{path}: ELF machine {e_machine:#x} is not amd64 or arm64")
    return machine, interp, needed


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise BuildError(f"{path}: {e.strerror}") from None


def dpkg_package(sysroot, package, arch, files):
    """(version, source package, source version) of `package`:`arch` as
    installed in `sysroot`; every one of `files` must be among its files."""
    admindir = os.path.join(sysroot, "var/lib/dpkg")
    name = f"{package}:{arch}"
    try:
        out = subprocess.run(
            ["dpkg-query", "--admindir", admindir, "-W", "-f", "${Version}\n${source:Package}\n${source:Version}\n", name],
            capture_output=True, text=True, check=False,
        )
        listed = subprocess.run(["dpkg-query", "--admindir", admindir, "-L", name], capture_output=True, text=True, check=False)
    except OSError as e:
        raise BuildError(f"dpkg-query: {e.strerror} (the runtime is taken from a Debian system's packages)") from None
    if out.returncode != 0 or listed.returncode != 0:
        raise BuildError(f"{name} is not installed in {sysroot}: {(out.stderr or listed.stderr).strip()}")
    version, source, source_version = out.stdout.split("\n")[:3]
    owned = set(listed.stdout.splitlines())
    for f in files:
        if "/" + f not in owned:
            raise BuildError(f"/{f} is not a file of {name} {version}")
    return version, source, source_version


def runtime_entries(sysroot, arch):
    """The glibc runtime's image entries {path: (mode, bytes or Symlink)} and
    the packages they come from [(package, version, source, source version)]."""
    rt = RUNTIME[arch]
    libdir = f"lib/{rt['triplet']}"
    entries = {}
    libc6 = [f"{libdir}/{rt['loader']}"] + [f"{libdir}/{lib}" for lib in LIBC6_LIBS]
    libgcc = [f"{libdir}/{lib}" for lib in LIBGCC_LIBS]
    packages = []
    for package, files, doc in (("libc6", libc6, "libc6"), ("libgcc-s1", libgcc, "libgcc-s1")):
        version, source, source_version = dpkg_package(sysroot, package, arch, files + [rt["interp"].lstrip("/")] * (package == "libc6"))
        packages.append((package, version, source, source_version))
        for f in files:
            entries[f] = (0o755, read(os.path.join(sysroot, f)))
        # libgcc-s1's doc directory is a symlink to gcc-12-base's: the file
        # it points at is what the image holds.
        entries[f"usr/share/doc/{doc}/copyright"] = (0o644, read(os.path.join(sysroot, f"usr/share/doc/{doc}/copyright")))
    entries[rt["interp"].lstrip("/")] = (0o777, Symlink(f"/{libdir}/{rt['loader']}"))
    lines = "".join(f"{p} {v} {arch} (source {s} {sv})\n" for p, v, s, sv in packages)
    entries["usr/share/doc/gpu-agent/runtime-packages"] = (
        0o644,
        ("# The glibc runtime in this image, from these Debian packages; their\n"
         "# licences are in /usr/share/doc/<package>/copyright.\n" + lines).encode(),
    )
    return entries, packages


def resolve(entries, path, hops=0):
    """The file `path` (absolute, in the image) names after symlinks, or None."""
    rel = path.lstrip("/")
    entry = entries.get(rel)
    if entry is None or hops > 8:
        return None
    if isinstance(entry[1], Symlink):
        target = entry[1].target
        if not target.startswith("/"):
            target = os.path.join("/" + os.path.dirname(rel), target)
        return resolve(entries, os.path.normpath(target), hops + 1)
    return rel


def check_loadable(path, data, entries, arch):
    """Refuses `data` (an ELF named `path`) unless its interpreter and every
    library it needs are in the image's `entries`."""
    machine, interp, needed = elf_facts(path, data)
    if machine != arch:
        raise BuildError(f"{path}: built for {machine}, the image is {arch}")
    if interp is not None and resolve(entries, interp) is None:
        raise BuildError(f"{path}: its ELF interpreter (PT_INTERP) {interp} is not in the image")
    dirs = [d.format(t=RUNTIME[arch]["triplet"]) for d in SEARCH_DIRS]
    for lib in needed:
        if not any(resolve(entries, f"/{d}/{lib}") for d in dirs):
            raise BuildError(
                f"{path}: needs {lib} (DT_NEEDED), which the image does not have "
                f"(it has {', '.join(sorted(os.path.basename(p) for p in entries if p.startswith(dirs[0] + '/')))})"
            )


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_bytes(entries, mtime):
    """A ustar archive of `entries` (path, mode, bytes, a Symlink or None
    for a directory), in the order given, owned by 0:0 with no user names."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path, mode, data in entries:
            info = tarfile.TarInfo(path)
            info.mode = mode
            info.mtime = mtime
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, Symlink):
                info.type = tarfile.SYMTYPE
                info.linkname = data.target
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gzip_bytes(data):
    buf = io.BytesIO()
    # No file name and a fixed time in the header: the same bytes each run.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as z:
        z.write(data)
    return buf.getvalue()


def canonical_json(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def build(agent, controller, version, ref, epoch, sysroot="/"):
    """The image's blobs and index: (index bytes, {digest: bytes}, facts)."""
    agent_bin, controller_bin = read(agent), read(controller)
    arch, _, _ = elf_facts(agent, agent_bin)
    files, packages = runtime_entries(sysroot, arch)
    files["tmp"] = (0o1777, None)
    files["usr/bin/gpu-agent"] = (0o755, agent_bin)
    files["usr/bin/gpu-controller"] = (0o755, controller_bin)
    for path, data in ((agent, agent_bin), (controller, controller_bin)):
        check_loadable(path, data, files, arch)
    # The runtime's own libraries load from the image too.
    for rel, (_, data) in sorted(files.items()):
        if rel.startswith("lib") and isinstance(data, bytes):
            check_loadable(f"{sysroot.rstrip('/')}/{rel}", data, files, arch)
    for rel in list(files):
        parent = os.path.dirname(rel)
        while parent and parent not in files:
            files[parent] = (0o755, None)
            parent = os.path.dirname(parent)
    layer = tar_bytes([(p, mode, data) for p, (mode, data) in sorted(files.items())], epoch)
    layer_gz = gzip_bytes(layer)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    labels = {
        "org.opencontainers.image.title": "gpu-agent",
        "org.opencontainers.image.description": "NVIDIA GPU node agent (gpu-agent) and cluster controller (gpu-controller)",
        "org.opencontainers.image.version": version,
    }
    config = canonical_json(
        {
            "created": created,
            "architecture": arch,
            "os": "linux",
            "config": {
                "Entrypoint": ["/usr/bin/gpu-agent"],
                "Env": ["PATH=/usr/bin"],
                "WorkingDir": "/",
                "Labels": labels,
            },
            "rootfs": {"type": "layers", "diff_ids": [sha256(layer)]},
            "history": [{"created": created, "created_by": "packaging/image/build.py"}],
        }
    )
    manifest = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": sha256(config), "size": len(config)},
            "layers": [{"mediaType": LAYER_GZIP, "digest": sha256(layer_gz), "size": len(layer_gz)}],
            "annotations": {"org.opencontainers.image.version": version, "org.opencontainers.image.created": created},
        }
    )
    index = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": INDEX,
            "manifests": [
                {
                    "mediaType": MANIFEST,
                    "digest": sha256(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        # containerd's import names the image by this one;
                        # skopeo, podman and the OCI spec by ref.name.
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref,
                    },
                }
            ],
        }
    )
    blobs = {sha256(b): b for b in (layer_gz, config, manifest)}
    facts = {
        "reference": ref,
        "architecture": arch,
        "manifest": sha256(manifest),
        "config": sha256(config),
        "layer": sha256(layer_gz),
        "diff_id": sha256(layer),
        "layer_bytes": len(layer_gz),
        "unpacked_bytes": sum(len(d) for _, d in files.values() if isinstance(d, bytes)),
        "binaries_bytes": {"gpu-agent": len(agent_bin), "gpu-controller": len(controller_bin)},
        "runtime_bytes": sum(len(d) for p, (_, d) in files.items() if p.startswith("lib") and isinstance(d, bytes)),
        "runtime_packages": [{"package": p, "version": v, "source": s, "source_version": sv} for p, v, s, sv in packages],
        "layer_tar_bytes": len(layer),
    }
    return index, blobs, facts


def layout_entries(index, blobs):
    entries = [
        ("blobs", 0o755, None),
        ("blobs/sha256", 0o755, None),
    ]
    for digest in sorted(blobs):
        entries.append((f"blobs/sha256/{digest.split(':', 1)[1]}", 0o644, blobs[digest]))
    entries.append(("index.json", 0o644, index))
    entries.append(("oci-layout", 0o644, canonical_json({"imageLayoutVersion": "1.0.0"})))
    return entries


def write_layout(directory, entries):
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    for path, mode, data in entries:
        target = os.path.join(directory, path)
        if data is None:
            os.makedirs(target, exist_ok=True)
        else:
            with open(target, "wb") as f:
                f.write(data)
            os.chmod(target, mode)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", required=True, help="gpu-agent (dynamically linked against glibc, or static)")
    p.add_argument("--controller", required=True, help="gpu-controller (likewise)")
    p.add_argument("--sysroot", default="/", help="the Debian system the glibc runtime is taken from (default /)")
    p.add_argument("--version", required=True)
    p.add_argument("--ref", required=True, help="the image reference, e.g. ghcr.io/gpu-agent/gpu-agent:0.1.0")
    p.add_argument("--out", required=True, help="the output directory")
    p.add_argument("--archive", help="the archive's file name (default gpu-agent-VERSION.oci.tar)")
    args = p.parse_args(argv)
    epoch_text = os.environ.get("SOURCE_DATE_EPOCH", "0")
    try:
        epoch = int(epoch_text)
    except ValueError:
        print(f"build.py: SOURCE_DATE_EPOCH: not a number of seconds: {epoch_text!r}", file=sys.stderr)
        return 2
    try:
        index, blobs, facts = build(args.agent, args.controller, args.version, args.ref, epoch, args.sysroot)
    except BuildError as e:
        print(f"build.py: {e}", file=sys.stderr)
        return 1
    entries = layout_entries(index, blobs)
    os.makedirs(args.out, exist_ok=True)
    write_layout(os.path.join(args.out, "oci"), entries)
    archive = os.path.join(args.out, args.archive or f"gpu-agent-{args.version}.oci.tar")
    data = tar_bytes(entries, epoch)
    tmp = archive + ".partial"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, archive)
    facts["archive"] = archive
    facts["archive_bytes"] = len(data)
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

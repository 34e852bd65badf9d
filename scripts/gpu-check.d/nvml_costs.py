#!/usr/bin/env python3
"""NVML's per-call costs, timed straight over libnvidia-ml with ctypes (no
pynvml needed), printed in the format of
../shared/real-hosts/h100-pcie-vm/nvml-costs.txt so that the output can
become the fake NVML's latency table (tests/fake-nvml/costs/).

Only functions that read are called: nothing here changes a GPU setting
(no MIG mode, no compute mode, no clocks, no reset, no persistence mode).
An event set is created, registered and freed (NVML's own bookkeeping in
this process).

Usage: nvml_costs.py [--lib PATH] [--calls N] [--gpu INDEX]
The first line of stdout is a JSON object (what the table says, for
gpu-check's summary), the table follows.
"""
import argparse
import ctypes
import json
import sys
import time

# NVML's return codes, as pynvml names its exceptions and NVML words them.
ERRORS = {
    1: ("Uninitialized", "Uninitialized"),
    2: ("InvalidArgument", "Invalid Argument"),
    3: ("NotSupported", "Not Supported"),
    4: ("NoPermission", "Insufficient Permissions"),
    5: ("AlreadyInitialized", "Already Initialized"),
    6: ("NotFound", "Not Found"),
    7: ("InsufficientSize", "Insufficient Size"),
    8: ("InsufficientPower", "Insufficient External Power"),
    9: ("DriverNotLoaded", "Driver Not Loaded"),
    10: ("Timeout", "Timeout"),
    11: ("IrqIssue", "Interrupt Request Issue"),
    12: ("LibraryNotFound", "NVML Shared Library Not Found"),
    13: ("FunctionNotFound", "Function Not Found"),
    14: ("CorruptedInforom", "Corrupted infoROM"),
    15: ("GpuIsLost", "GPU is lost"),
    16: ("ResetRequired", "GPU requires restart"),
    17: ("OperatingSystem", "The operating system has blocked the request."),
    18: ("LibRmVersionMismatch", "RM has detected an NVML/RM version mismatch."),
    19: ("InUse", "In use by another client"),
    20: ("Memory", "Insufficient Memory"),
    21: ("NoData", "No data"),
    22: ("VgpuEccNotSupported", "The requested vgpu operation is not available on target device, becasue ECC is enabled"),
    23: ("InsufficientResources", "Ran out of critical resources, other than memory"),
    24: ("FreqNotSupported", "Ran out of critical resources, other than memory"),
    25: ("ArgumentVersionMismatch", "The provided version is invalid/unsupported"),
    26: ("Deprecated", "The requested functionality has been deprecated"),
    27: ("NotReady", "The system is not ready for the request"),
    28: ("GpuNotFound", "No GPUs were found"),
    29: ("InvalidState", "Resource not in correct state to perform requested operation"),
    999: ("Unknown", "Unknown Error"),
}

SUCCESS = 0
INSUFFICIENT_SIZE = 7
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID_CRITICAL = 0x8


class NvmlError(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code

    def __str__(self):
        cls, text = ERRORS.get(self.code, ("Unknown", f"Unknown Error {self.code}"))
        return f"NVMLError_{cls}:{text}"


class Missing(Exception):
    """The library does not export the function."""


def fmt_name(name):
    return f"{name:<48}"


class Lib:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)

    def fn(self, name, *argtypes):
        try:
            f = getattr(self.lib, name)
        except AttributeError:
            raise Missing(name) from None
        f.argtypes = list(argtypes)
        f.restype = ctypes.c_int
        return f

    def has(self, name):
        return hasattr(self.lib, name)


def check(rc):
    if rc != SUCCESS:
        raise NvmlError(rc)


def loaded_from(fragment):
    """The file the dynamic loader mapped for `fragment` (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and fragment in parts[-1]:
                    return parts[-1]
    except OSError:
        pass
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="libnvidia-ml.so.1")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--gpu", type=int, default=0)
    args = ap.parse_args()
    try:
        nv = Lib(args.lib)
    except OSError as e:
        print(json.dumps({"error": f"cannot load {args.lib}: {e}"}))
        return 1
    P = ctypes.POINTER
    c_uint, c_int, c_ull, c_char_p, c_void_p = (ctypes.c_uint, ctypes.c_int, ctypes.c_ulonglong,
                                                ctypes.c_char_p, ctypes.c_void_p)
    out = []
    summary = {"lib": loaded_from("nvidia-ml") or args.lib, "lines": 0, "missing": [], "errors": {}}

    def init_name():
        return "nvmlInit_v2" if nv.has("nvmlInit_v2") else "nvmlInit"

    try:
        init = nv.fn(init_name())
        shutdown = nv.fn("nvmlShutdown")
    except Missing as e:
        print(json.dumps({"error": f"{args.lib} exports no {e}"}))
        return 1
    t = time.perf_counter()
    rc = init()
    first_ms = (time.perf_counter() - t) * 1e3
    if rc != SUCCESS:
        print(json.dumps({"error": f"nvmlInit failed: {NvmlError(rc)}"}))
        return 1
    shutdown()
    t = time.perf_counter()
    check(init())
    again_ms = (time.perf_counter() - t) * 1e3
    summary["init_first_ms"], summary["init_again_ms"] = first_ms, again_ms

    buf = ctypes.create_string_buffer(256)
    version = "?"
    try:
        f = nv.fn("nvmlSystemGetDriverVersion", c_char_p, c_uint)
        if f(buf, 256) == SUCCESS:
            version = buf.value.decode(errors="replace")
    except Missing:
        pass
    summary["driver"] = version

    handle = c_void_p()
    index_fn = "nvmlDeviceGetHandleByIndex_v2" if nv.has("nvmlDeviceGetHandleByIndex_v2") else "nvmlDeviceGetHandleByIndex"
    try:
        check(nv.fn(index_fn, c_uint, P(c_void_p))(args.gpu, ctypes.byref(handle)))
    except (Missing, NvmlError) as e:
        print(json.dumps({"error": f"no handle for GPU {args.gpu}: {e}"}))
        return 1
    h = handle
    uuid = ctypes.create_string_buffer(96)
    bus = ctypes.create_string_buffer(64)
    name = ctypes.create_string_buffer(96)
    try:
        nv.fn("nvmlDeviceGetUUID", c_void_p, c_char_p, c_uint)(h, uuid, 96)
        nv.fn("nvmlDeviceGetName", c_void_p, c_char_p, c_uint)(h, name, 96)
    except Missing:
        pass
    # nvmlPciInfo_t: busIdLegacy[16], domain, bus, device, pciDeviceId,
    # pciSubSystemId (unsigned int each), busId[32].
    pci = ctypes.create_string_buffer(256)
    pci_fn = "nvmlDeviceGetPciInfo_v3" if nv.has("nvmlDeviceGetPciInfo_v3") else "nvmlDeviceGetPciInfo"
    try:
        if nv.fn(pci_fn, c_void_p, c_void_p)(h, pci) == SUCCESS:
            bus.value = pci.raw[36:68].split(b"\0")[0]
    except Missing:
        pass
    summary["gpu"] = {"index": args.gpu, "name": name.value.decode(errors="replace"),
                      "uuid": uuid.value.decode(errors="replace"), "bus_id": bus.value.decode(errors="replace")}

    def timed(label, call, calls=None):
        """`call` once per sample: its time; an NVML error is noted, as pynvml's exception."""
        n = calls or args.calls
        times = []
        err = ""
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                try:
                    call()
                except NvmlError as e:
                    err = str(e)
                times.append((time.perf_counter() - t0) * 1e6)
        except Missing as e:
            out.append(f"# {label}: not exported by this library ({e})")
            summary["missing"].append(label)
            return
        times.sort()
        p50, mx = times[len(times) // 2], times[-1]
        out.append(f"{fmt_name(label)} p50 {p50:>10.1f} us  max {mx:>10.1f} us  {err}")
        summary["lines"] += 1
        if err:
            summary["errors"][label] = err

    def call(fname, *argtypes):
        f = nv.fn(fname, *argtypes)

        def run(*a):
            check(f(*a))
        return run

    ui, ii, ull = c_uint(), c_int(), c_ull()
    ui2, ui3, ui4 = c_uint(), c_uint(), c_uint()
    ii2 = c_int()
    s = ctypes.create_string_buffer(256)
    mem = ctypes.create_string_buffer(64)     # nvmlMemory_t: 3 unsigned long long
    util = ctypes.create_string_buffer(16)    # nvmlUtilization_t: 2 unsigned int
    viol = ctypes.create_string_buffer(32)    # nvmlViolationTime_t: 2 unsigned long long
    ev = ctypes.create_string_buffer(64)      # nvmlEventData_t
    procs = ctypes.create_string_buffer(64 * 64)
    pages = (c_ull * 512)()
    licence = ctypes.create_string_buffer(4096)  # nvmlGridLicensableFeatures_t (about 900 bytes)

    def field(fid):
        """One nvmlFieldValue_t (40 bytes) asking for NVML field `fid`, scope 0."""
        fv = (c_uint * 10)()
        fv[0] = fid
        return fv

    def lazy(fname, *argtypes):
        """Resolves `fname` at the first call, so a missing one is a Missing there."""
        holder = {}

        def run(*a):
            if "f" not in holder:
                holder["f"] = nv.fn(fname, *argtypes)
            check(holder["f"](*a))
        return run

    def v(newer, older):
        """The versioned name where the library exports it."""
        return newer if nv.has(newer) else older

    bus_id = bus.value
    uuid_v = uuid.value

    cases = [
        ("nvmlSystemGetDriverVersion", lambda f=lazy("nvmlSystemGetDriverVersion", c_char_p, c_uint): f(s, 256)),
        ("nvmlSystemGetCudaDriverVersion", lambda f=lazy("nvmlSystemGetCudaDriverVersion", P(c_int)): f(ctypes.byref(ii))),
        ("nvmlDeviceGetCount", lambda f=lazy(v("nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"), P(c_uint)): f(ctypes.byref(ui))),
        ("nvmlDeviceGetHandleByIndex", lambda f=lazy(index_fn, c_uint, P(c_void_p)): f(args.gpu, ctypes.byref(c_void_p()))),
        ("nvmlDeviceGetHandleByUUID", lambda f=lazy("nvmlDeviceGetHandleByUUID", c_char_p, P(c_void_p)): f(uuid_v, ctypes.byref(c_void_p()))),
        ("nvmlDeviceGetHandleByPciBusId", lambda f=lazy(v("nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleByPciBusId"), c_char_p, P(c_void_p)): f(bus_id, ctypes.byref(c_void_p()))),
        ("nvmlDeviceGetUUID", lambda f=lazy("nvmlDeviceGetUUID", c_void_p, c_char_p, c_uint): f(h, s, 96)),
        ("nvmlDeviceGetName", lambda f=lazy("nvmlDeviceGetName", c_void_p, c_char_p, c_uint): f(h, s, 96)),
        ("nvmlDeviceGetMinorNumber", lambda f=lazy("nvmlDeviceGetMinorNumber", c_void_p, P(c_uint)): f(h, ctypes.byref(ui))),
        ("nvmlDeviceGetPciInfo", lambda f=lazy(pci_fn, c_void_p, c_void_p): f(h, pci)),
        ("nvmlDeviceGetMemoryInfo", lambda f=lazy("nvmlDeviceGetMemoryInfo", c_void_p, c_void_p): f(h, mem)),
        ("nvmlDeviceGetCudaComputeCapability", lambda f=lazy("nvmlDeviceGetCudaComputeCapability", c_void_p, P(c_int), P(c_int)): f(h, ctypes.byref(ii), ctypes.byref(ii2))),
        ("nvmlDeviceGetMigMode", lambda f=lazy("nvmlDeviceGetMigMode", c_void_p, P(c_uint), P(c_uint)): f(h, ctypes.byref(ui), ctypes.byref(ui2))),
        ("nvmlDeviceGetMaxMigDeviceCount", lambda f=lazy("nvmlDeviceGetMaxMigDeviceCount", c_void_p, P(c_uint)): f(h, ctypes.byref(ui))),
        ("nvmlDeviceGetBrand", lambda f=lazy("nvmlDeviceGetBrand", c_void_p, P(c_int)): f(h, ctypes.byref(ii))),
        ("nvmlDeviceGetArchitecture", lambda f=lazy("nvmlDeviceGetArchitecture", c_void_p, P(c_uint)): f(h, ctypes.byref(ui))),
        ("nvmlDeviceGetSerial", lambda f=lazy("nvmlDeviceGetSerial", c_void_p, c_char_p, c_uint): f(h, s, 64)),
        ("nvmlDeviceGetVbiosVersion", lambda f=lazy("nvmlDeviceGetVbiosVersion", c_void_p, c_char_p, c_uint): f(h, s, 64)),
        ("nvmlDeviceGetNvLinkState(link 0)", lambda f=lazy("nvmlDeviceGetNvLinkState", c_void_p, c_uint, P(c_int)): f(h, 0, ctypes.byref(ii))),
        ("nvmlDeviceGetTemperature", lambda f=lazy("nvmlDeviceGetTemperature", c_void_p, c_int, P(c_uint)): f(h, 0, ctypes.byref(ui))),
        ("nvmlDeviceGetTemperatureThreshold(slowdown)", lambda f=lazy("nvmlDeviceGetTemperatureThreshold", c_void_p, c_int, P(c_uint)): f(h, 1, ctypes.byref(ui))),
        ("nvmlDeviceGetPowerUsage", lambda f=lazy("nvmlDeviceGetPowerUsage", c_void_p, P(c_uint)): f(h, ctypes.byref(ui))),
        ("nvmlDeviceGetTotalEnergyConsumption", lambda f=lazy("nvmlDeviceGetTotalEnergyConsumption", c_void_p, P(c_ull)): f(h, ctypes.byref(ull))),
        ("nvmlDeviceGetUtilizationRates", lambda f=lazy("nvmlDeviceGetUtilizationRates", c_void_p, c_void_p): f(h, util)),
        ("nvmlDeviceGetClockInfo(SM)", lambda f=lazy("nvmlDeviceGetClockInfo", c_void_p, c_int, P(c_uint)): f(h, 1, ctypes.byref(ui))),
        ("nvmlDeviceGetClockInfo(MEM)", lambda f=lazy("nvmlDeviceGetClockInfo", c_void_p, c_int, P(c_uint)): f(h, 2, ctypes.byref(ui))),
        ("nvmlDeviceGetEncoderUtilization", lambda f=lazy("nvmlDeviceGetEncoderUtilization", c_void_p, P(c_uint), P(c_uint)): f(h, ctypes.byref(ui), ctypes.byref(ui2))),
        ("nvmlDeviceGetPcieReplayCounter", lambda f=lazy("nvmlDeviceGetPcieReplayCounter", c_void_p, P(c_uint)): f(h, ctypes.byref(ui))),
        ("nvmlDeviceGetRemappedRows", lambda f=lazy("nvmlDeviceGetRemappedRows", c_void_p, P(c_uint), P(c_uint), P(c_uint), P(c_uint)): f(h, ctypes.byref(ui), ctypes.byref(ui2), ctypes.byref(ui3), ctypes.byref(ui4))),
    ]

    def retired_pages(f=lazy_raw("nvmlDeviceGetRetiredPages", nv, c_void_p, c_int, P(c_uint), P(c_ull))):
        # As pynvml: ask for the count, then for the pages.
        count = c_uint(0)
        rc = f()(h, 1, ctypes.byref(count), None)
        if rc == SUCCESS and count.value == 0:
            return
        if rc not in (SUCCESS, INSUFFICIENT_SIZE):
            raise NvmlError(rc)
        count.value = min(count.value, 512)
        check(f()(h, 1, ctypes.byref(count), pages))

    def running_processes(f=lazy_raw(v("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses"),
                                     nv, c_void_p, P(c_uint), c_void_p)):
        count = c_uint(0)
        rc = f()(h, ctypes.byref(count), None)
        if rc == SUCCESS:
            return
        if rc != INSUFFICIENT_SIZE:
            raise NvmlError(rc)
        count.value = min(count.value + 5, 64)
        check(f()(h, ctypes.byref(count), procs))

    cases += [
        ("nvmlDeviceGetRetiredPages(DBE)", retired_pages),
        ("nvmlDeviceGetRetiredPagesPendingStatus", lambda f=lazy("nvmlDeviceGetRetiredPagesPendingStatus", c_void_p, P(c_int)): f(h, ctypes.byref(ii))),
        ("nvmlDeviceGetTotalEccErrors(uncorr,volatile)", lambda f=lazy("nvmlDeviceGetTotalEccErrors", c_void_p, c_int, c_int, P(c_ull)): f(h, 1, 0, ctypes.byref(ull))),
        ("nvmlDeviceGetViolationStatus(power)", lambda f=lazy("nvmlDeviceGetViolationStatus", c_void_p, c_int, c_void_p): f(h, 0, viol)),
        ("nvmlDeviceGetComputeRunningProcesses", running_processes),
        ("nvmlDeviceGetComputeMode", lambda f=lazy("nvmlDeviceGetComputeMode", c_void_p, P(c_int)): f(h, ctypes.byref(ii))),
        ("nvmlDeviceGetSupportedEventTypes", lambda f=lazy("nvmlDeviceGetSupportedEventTypes", c_void_p, P(c_ull)): f(h, ctypes.byref(ull))),
        # The calls behind dcgm-exporter's other fields (tests/fake-nvml/costs/
        # modelled.txt models them until a run here measures them).
        ("nvmlDeviceGetInforomVersion(OEM)", lambda f=lazy("nvmlDeviceGetInforomVersion", c_void_p, c_int, c_char_p, c_uint): f(h, 0, s, 16)),
        ("nvmlDeviceGetInforomImageVersion", lambda f=lazy("nvmlDeviceGetInforomImageVersion", c_void_p, c_char_p, c_uint): f(h, s, 16)),
        ("nvmlSystemGetNVMLVersion", lambda f=lazy("nvmlSystemGetNVMLVersion", c_char_p, c_uint): f(s, 80)),
        ("nvmlDeviceGetGridLicensableFeatures_v4", lambda f=lazy("nvmlDeviceGetGridLicensableFeatures_v4", c_void_p, c_void_p): f(h, licence)),
        ("nvmlDeviceGetNvLinkErrorCounter(link 0, CRC flit)", lambda f=lazy("nvmlDeviceGetNvLinkErrorCounter", c_void_p, c_uint, c_int, P(c_ull)): f(h, 0, 2, ctypes.byref(ull))),
        ("nvmlDeviceGetFieldValues(ECC SBE volatile total)", lambda f=lazy("nvmlDeviceGetFieldValues", c_void_p, c_int, c_void_p): f(h, 1, field(3))),
        ("nvmlDeviceGetFieldValues(perf policy power)", lambda f=lazy("nvmlDeviceGetFieldValues", c_void_p, c_int, c_void_p): f(h, 1, field(74))),
    ]
    for label, fn in cases:
        timed(label, fn)

    # Events: the two types gpu-agent's health watch registers (those of
    # them the GPU supports).
    types = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC
    try:
        sup = c_ull()
        if nv.fn("nvmlDeviceGetSupportedEventTypes", c_void_p, P(c_ull))(h, ctypes.byref(sup)) == SUCCESS:
            types = (sup.value & types) or types
    except Missing:
        pass
    ev_create = lazy_raw("nvmlEventSetCreate", nv, P(c_void_p))
    ev_register = lazy_raw("nvmlDeviceRegisterEvents", nv, c_void_p, c_ull, c_void_p)
    ev_free = lazy_raw("nvmlEventSetFree", nv, c_void_p)

    def event_set():
        es = c_void_p()
        check(ev_create()(ctypes.byref(es)))
        try:
            check(ev_register()(h, types, es))
        finally:
            ev_free()(es)

    timed("event set create+register+free", event_set)
    wait_set = c_void_p()
    wait_ready = False
    try:
        if ev_create()(ctypes.byref(wait_set)) == SUCCESS:
            wait_ready = True
            ev_register()(h, types, wait_set)
    except Missing:
        pass
    if wait_ready:
        ev_wait = lazy(v("nvmlEventSetWait_v2", "nvmlEventSetWait"), c_void_p, c_void_p, c_uint)
        timed("nvmlEventSetWait(timeout 0)", lambda: ev_wait(wait_set, ev, 0))
        ev_free()(wait_set)
    else:
        out.append("# nvmlEventSetWait(timeout 0): no event set (nvmlEventSetCreate failed or is not exported)")

    gpm_alloc = lazy_raw("nvmlGpmSampleAlloc", nv, P(c_void_p))
    gpm_get = lazy_raw("nvmlGpmSampleGet", nv, c_void_p, c_void_p)
    gpm_free = lazy_raw("nvmlGpmSampleFree", nv, c_void_p)

    def gpm():
        sample = c_void_p()
        check(gpm_alloc()(ctypes.byref(sample)))
        try:
            check(gpm_get()(h, sample))
        finally:
            gpm_free()(sample)

    timed("GPM sample alloc+get+free", gpm)
    shutdown()

    header = [
        f"# NVML per-call costs on this host (ctypes over {summary['lib']} {version}, "
        f"{args.calls} calls each unless noted, GPU {args.gpu}: {summary['gpu']['name']} "
        f"{summary['gpu']['bus_id']}; measured by scripts/gpu-check)",
        f"# nvmlInit: {first_ms:.1f} ms the first time in this process, {again_ms:.1f} ms again after nvmlShutdown.",
        f"{fmt_name('nvmlInit (first)')} {first_ms:.1f} ms",
        f"{fmt_name('nvmlInit (again)')} {again_ms:.1f} ms",
    ]
    print(json.dumps(summary))
    print("\n".join(header + out))
    return 0


def lazy_raw(fname, nv, *argtypes):
    """A getter for `fname` bound with `argtypes`, resolved at its first
    use (a missing symbol is a Missing there); returns the raw return code."""
    holder = {}

    def get():
        if "f" not in holder:
            holder["f"] = nv.fn(fname, *argtypes)
        return holder["f"]
    return get


if __name__ == "__main__":
    sys.exit(main())

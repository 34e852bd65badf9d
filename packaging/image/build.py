#!/usr/bin/env python3
"""Writes gpu-agent's container image as an OCI image layout and an OCI
archive (a tar of that layout), with no container engine and nothing but
Python's standard library.

The image is one gzip layer on an empty base:

    /usr/bin/gpu-agent       0755  (the entrypoint)
    /usr/bin/gpu-controller  0755
    /tmp                     1777  (empty; a mount point for a writable dir)

Both binaries must be static (no ELF PT_INTERP): the base has no dynamic
loader and no libc. The output is the same bytes on every run for the same
inputs: entries sorted, owners 0:0 with no names, every mtime the one given
(SOURCE_DATE_EPOCH, default 0), gzip without a name or a time.

usage: build.py --agent BIN --controller BIN --version V --ref NAME --out DIR
Writes DIR/oci/ (the layout) and DIR/<archive> (default gpu-agent-V.oci.tar).
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import tarfile
import time

PT_INTERP = 3
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


class BuildError(Exception):
    pass


def elf_interp(path, data):
    """The ELF program interpreter `data` asks for, or None when static.
    Raises BuildError when it is not a 64-bit little-endian ELF."""
    if data[:4] != b"\x7fELF":
        raise BuildError(f"{path}: not an ELF executable")
    if data[4] != 2 or data[5] != 1:
        raise BuildError(f"{path}: not a 64-bit little-endian ELF")
    (e_phoff,) = struct.unpack_from("<Q", data, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack_from("<IIQQQQ", data, off)
        if p_type == PT_INTERP:
            return data[p_offset : p_offset + p_filesz].rstrip(b"\0").decode(errors="replace")
    return None


def elf_machine(data):
    (e_machine,) = struct.unpack_from("<H", data, 0x12)
    return {0x3E: "amd64", 0xB7: "arm64"}.get(e_machine)


def static_binary(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BuildError(f"{path}: {e.strerror}") from None
    interp = elf_interp(path, data)
    if interp is not None:
        raise BuildError(
            f"{path}: dynamically linked (PT_INTERP {interp}); the image has no libc: "
            'build it with RUSTFLAGS="-C target-feature=+crt-static" --target x86_64-unknown-linux-gnu'
        )
    arch = elf_machine(data)
    if arch is None:
        raise BuildError(f"{path}: ELF machine {struct.unpack_from('<H', data, 0x12)[0]:#x} is not amd64 or arm64")
    return data, arch


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_bytes(entries, mtime):
    """A ustar archive of `entries` (path, mode, bytes or None for a
    directory), in the order given, owned by 0:0 with no user names."""
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


def build(agent, controller, version, ref, epoch):
    """The image's blobs and index: (index bytes, {digest: bytes}, facts)."""
    agent_bin, arch = static_binary(agent)
    controller_bin, controller_arch = static_binary(controller)
    if controller_arch != arch:
        raise BuildError(f"{controller}: built for {controller_arch}, {agent} for {arch}")

    layer = tar_bytes(
        [
            ("tmp", 0o1777, None),
            ("usr", 0o755, None),
            ("usr/bin", 0o755, None),
            ("usr/bin/gpu-agent", 0o755, agent_bin),
            ("usr/bin/gpu-controller", 0o755, controller_bin),
        ],
        epoch,
    )
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
        "unpacked_bytes": len(agent_bin) + len(controller_bin),
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
    p.add_argument("--agent", required=True, help="the static gpu-agent")
    p.add_argument("--controller", required=True, help="the static gpu-controller")
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
        index, blobs, facts = build(args.agent, args.controller, args.version, args.ref, epoch)
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

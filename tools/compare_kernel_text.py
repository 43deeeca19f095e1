"""Whether two versions of the kernels compile to the same machine code: every specialization the
library lists (``specs.all_specs(arch)``), compiled from this checkout and from another commit, with
the SHA-256 of every ELF section named ``.text*`` (each kernel's code) compared per spec key and arch.
CPU only (NVRTC); no GPU needed.

Each side's specs come from its own Python (``sagebwd_cp/`` of that version, in a subprocess), and its
kernels from its own ``kernels/`` and ``ptx/``, so a change that moves a size from the kernels into a
define compiles the old sources with the old defines. Keys on one side only are listed (new
specializations) and compared with nothing.

    python tools/compare_kernel_text.py --base main --arch sm_90
    python tools/compare_kernel_text.py --base HEAD~3            # sm_80, sm_86, sm_89 and sm_90

The hashes of each compile are kept by its source, options and NVRTC version (``--cache``, default in
the kernel cache folder), so a rerun compiles only what changed. Exit status 1 if any spec differs.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")

# Run in a subprocess with one version's sagebwd_cp first on sys.path: its specs, their options per
# arch, and its flattened sources (compiled from its own kernels/ and ptx/).
_LIST_SPECS = r"""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import sagebwd_cp
assert os.path.realpath(sagebwd_cp.__file__).startswith(os.path.realpath(root)), sagebwd_cp.__file__
from sagebwd_cp.gpu import compiler, specs
dirs = (os.path.join(root, "kernels"), os.path.join(root, "ptx"))
compiler.source_dirs = lambda: dirs
out = {}
for arch in sys.argv[2].split(","):
    rows, sources = [], {}
    for s in specs.all_specs(arch):
        if s.filename not in sources:
            sources[s.filename] = compiler.flatten_source(s.filename, dirs)
        rows.append({"key": s.key, "filename": s.filename, "options": list(s.options(arch)), "layout": s.layout,
                     "entries": list(s.entries)})
    out[arch] = {"specs": rows, "sources": sources}
json.dump(out, sys.stdout)
"""


def list_specs(root: Path, archs) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGEBWD_")}  # the default choices
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-c", _LIST_SPECS, str(root), ",".join(archs)], env=env, cwd=tempfile.gettempdir(),
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"listing the specs of {root} failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def text_sections(elf: bytes) -> dict:
    """{section name: SHA-256} of the ELF64 sections whose names start with .text."""
    assert elf[:4] == b"\x7fELF" and elf[4] == 2, "an ELF64 image"
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i):
        name, kind, flags, addr, offset, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, kind, offset, size

    _, _, str_off, str_size = header(shstrndx)
    names = elf[str_off:str_off + str_size]
    out = {}
    for i in range(shnum):
        name_off, kind, offset, size = header(i)
        name = names[name_off:names.index(b"\0", name_off)].decode()
        if name.startswith(".text"):
            data = b"" if kind == 8 else elf[offset:offset + size]  # SHT_NOBITS holds no bytes
            out[name] = hashlib.sha256(data).hexdigest()
    return out


class _Spec:
    """What compiler._nvrtc_compile reads of a spec, with one version's options."""

    def __init__(self, key, options, layout):
        self.key, self._options, self.layout = key, tuple(options), layout

    def options(self, arch, ptxas_level=3):
        return self._options


def _compile(source: str, row: dict, arch: str) -> dict:
    from sagebwd_cp.gpu import compiler

    cubin, log = compiler._nvrtc_compile(source, _Spec(row["key"], row["options"], row["layout"]), arch)
    reports = compiler.parse_ptxas_report(log)
    return {"text": text_sections(bytes(cubin)), "shared": compiler._layout_bytes(log),
            "registers": {n: r.registers for n, r in reports.items()},
            "spills": sum(r.spill_stores + r.spill_loads for r in reports.values())}


def _digest(source: str, row: dict, arch: str, nvrtc: tuple) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(row["options"]), arch, repr(row["layout"]), repr(nvrtc)):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="the commit to compare this checkout with (default main)")
    ap.add_argument("--arch", nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--cache", type=Path, default=None, help="the hashes' file (default: kernel cache folder)")
    args = ap.parse_args(argv)

    from sagebwd_cp.gpu import compiler

    cache_path = args.cache or compiler.cache_dir() / "text_hashes.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    nvrtc = compiler.nvrtc_version()

    with tempfile.TemporaryDirectory() as base_root:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "sagebwd_cp", "kernels", "ptx"],
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(base_root)
        sides = {"base": list_specs(Path(base_root), args.arch), "new": list_specs(ROOT, args.arch)}

    jobs, results = {}, {}  # digest -> (source, row, arch)
    for side, listing in sides.items():
        for arch in args.arch:
            for row in listing[arch]["specs"]:
                source = listing[arch]["sources"][row["filename"]]
                d = _digest(source, row, arch, nvrtc)
                row.setdefault("digest", {})[arch] = d
                if d not in cache:
                    jobs[d] = (source, row, arch)
    print(f"{sum(len(l[a]['specs']) for l in sides.values() for a in args.arch)} compiles, "
          f"{len(jobs)} not cached; {args.jobs} processes", flush=True)
    start, done = time.time(), 0
    order = sorted(jobs, key=lambda d: not jobs[d][1]["filename"].startswith("backward"))  # longest first
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile, *jobs[d]): d for d in order}
        for future in concurrent.futures.as_completed(futures):
            cache[futures[future]] = future.result()
            done += 1
            if done % 25 == 0 or done == len(jobs):
                print(f"  {done}/{len(jobs)} compiled, {time.time() - start:.0f} s", flush=True)
                tmp = cache_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(cache))
                tmp.replace(cache_path)

    failures = 0
    for arch in args.arch:
        base = {r["key"]: r for r in sides["base"][arch]["specs"]}
        new = {r["key"]: r for r in sides["new"][arch]["specs"]}
        if base.keys() != new.keys():
            print(f"{arch}: spec keys differ: only base {sorted(base.keys() - new.keys())}, "
                  f"only new {len(new.keys() - base.keys())}")
        differ, spills = [], []
        for key in sorted(base.keys() & new.keys()):
            a, b = cache[base[key]["digest"][arch]], cache[new[key]["digest"][arch]]
            if a["text"] != b["text"] or a["shared"] != b["shared"]:
                differ.append(key)
                code = "code differs" if a["text"] != b["text"] else "same code"
                print(f"  {arch} {key}: differs ({code}; shared {a['shared']} -> {b['shared']}, registers "
                      f"{a['registers']} -> {b['registers']})")
            if b["spills"]:
                spills.append(key)
        failures += len(differ)
        print(f"{arch}: {len(base.keys() & new.keys())} specs compared, {len(differ)} differ, "
              f"{len(spills)} spill (new)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

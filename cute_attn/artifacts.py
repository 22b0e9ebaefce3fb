"""Read compiled kernels: instruction counts from PTX, resources from the cubin (no GPU, no CUDA
toolkit needed), and ptxas's own report when a ``ptxas`` binary is on PATH.

Used by tools/compile_variants.py, tools/inspect_ptx.py and the compile tests.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import asdict, dataclass

# PTX instruction families worth counting in an attention kernel
PTX_PATTERNS = {
    "mma.sync": r"\bmma\.sync\.aligned\.m16n8k16\b",
    "wgmma": r"\bwgmma\.mma_async\b",
    "ldmatrix": r"\bldmatrix\.sync\b",
    "cp.async": r"\bcp\.async\.c[ag]\.shared\.global\b",
    "cp.async.bulk.tensor": r"\bcp\.async\.bulk\.tensor\b",
    "mbarrier": r"\bmbarrier\.",
    "setmaxnreg": r"\bsetmaxnreg\b",
    "ex2": r"\bex2\.approx\b",
    "bar.sync": r"\bbar(rier)?\.sync\b",
    "ld.local/st.local": r"\b(ld|st)\.local\b",
}

# EIATTR codes in a cubin's .nv.info section
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F


@dataclass
class KernelReport:
    name: str
    registers: int | None = None
    stack_frame: int | None = None  # bytes of local memory per thread (0: no spills, no local arrays)
    spill_stores: int | None = None  # bytes, from ptxas -v when available
    spill_loads: int | None = None
    static_smem: int | None = None
    counts: dict | None = None

    def as_row(self) -> dict:
        return asdict(self)


def count_ptx(ptx: str) -> dict:
    body = "\n".join(line.split("//", 1)[0] for line in ptx.splitlines())
    return {name: len(re.findall(pat, body)) for name, pat in PTX_PATTERNS.items()}


def ptx_target(ptx: str) -> str | None:
    m = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
    return m.group(1) if m else None


def cubin_resources(cubin: bytes) -> dict:
    """Registers, stack frame and static shared memory of the (single) kernel in a cubin."""
    if cubin[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]

    def name(off):
        return cubin[strtab + off : cubin.index(b"\0", strtab + off)].decode()

    res = {"registers": None, "stack_frame": None, "static_smem": 0}
    for sec in sections:
        sname, off, size = name(sec[0]), sec[4], sec[5]
        if sname == ".nv.info":
            p = off
            while p < off + size:
                fmt, attr = cubin[p], cubin[p + 1]
                length = struct.unpack_from("<H", cubin, p + 2)[0] if fmt == 4 else 0
                if fmt == 4 and attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and length == 8:
                    value = struct.unpack_from("<I", cubin, p + 8)[0]
                    res["registers" if attr == _EIATTR_REGCOUNT else "stack_frame"] = value
                p += 4 + length
        elif sname.startswith(".nv.shared.") and not sname.startswith(".nv.shared.reserved"):
            res["static_smem"] += size
    if res["stack_frame"] is None and res["registers"] is not None:
        res["stack_frame"] = 0
    return res


def ptxas_report(ptx: str, target: str | None = None) -> dict | None:
    """Run ``ptxas -v`` on the PTX when a ptxas binary is available (exact spill bytes)."""
    ptxas = shutil.which("ptxas")
    target = target or ptx_target(ptx)
    if ptxas is None or target is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        proc = subprocess.run([ptxas, f"-arch={target}", "-v", f.name, "-o", "/dev/null"],
                              capture_output=True, text=True)
    log = proc.stderr
    if proc.returncode != 0:
        return None

    def grab(pat):
        m = re.search(pat, log)
        return int(m.group(1)) if m else None

    return {
        "registers": grab(r"Used (\d+) registers"),
        "stack_frame": grab(r"(\d+) bytes stack frame"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
    }


def report(name: str, ptx: str | None, cubin: bytes | None, run_ptxas: bool = True) -> KernelReport:
    rep = KernelReport(name)
    if ptx:
        rep.counts = count_ptx(ptx)
    if cubin:
        for k, v in cubin_resources(cubin).items():
            setattr(rep, k, v)
    # the cubin is what runs; ptxas -v on the PTX (default options) is only a fallback
    if ptx and run_ptxas and not cubin:
        extra = ptxas_report(ptx)
        if extra:
            for k, v in extra.items():
                if v is not None:
                    setattr(rep, k, v)
    return rep


def format_table(reports: list[KernelReport]) -> str:
    cols = ["mma.sync", "wgmma", "ldmatrix", "cp.async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg"]
    head = "| variant | regs | stack | spill st/ld | static smem | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (5 + len(cols))]

    def fmt(v):
        return "-" if v is None else str(v)

    for r in reports:
        spills = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        counts = [fmt((r.counts or {}).get(c)) for c in cols]
        lines.append(
            f"| {r.name} | {fmt(r.registers)} | {fmt(r.stack_frame)} | {spills} | {fmt(r.static_smem)} | "
            + " | ".join(counts) + " |"
        )
    return "\n".join(lines)

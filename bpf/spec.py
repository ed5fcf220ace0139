"""Probe targets from bpf/probes.toml: parsing, the BPF-side table, argument decoding, and which
of a library's exports each probe attaches to (`resolve_exports`, `resolve_library`).

Pure (no privileges; `resolve_library` reads the library file). x86-64 System V only: the first six register-sized arguments are in
rdi, rsi, rdx, rcx, r8, r9; the rest are on the caller's stack, read at entry from [sp+8k].
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from stacklens.errors import InputError

from stacklens.bpf.events_abi import SL_BLOB, SL_NARGS, SlSpec

DEFAULT_SPEC = Path(__file__).with_name("probes.toml")
KINDS = {"launch", "graph", "capture", "alloc", "free", "memcpy", "sync", "name", "collective"}
SCALARS = {"u32", "i32", "u64", "ptr", "size", "str", "memcpy_kind"}
MEMCPY_KINDS = {0: "HtoH", 1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "default"}
SL_F_RETURN, SL_F_STACK, SL_F_NAME = 1, 2, 4
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class StructField:
    name: str
    type: str
    offset: int


@dataclass(frozen=True)
class ProbeSpec:
    index: int               # attach cookie / index into the BPF `specs` array
    library: str             # regex on the mapped file's basename
    symbol: str
    kind: str
    args: tuple[tuple[str, str], ...]
    ret: bool = False
    stack: bool = True
    kernel: str = ""
    kernel_from: str = "handle"
    bytes_arg: str = ""
    direction: str = ""
    direction_arg: str = ""
    out: str = ""
    name_arg: str = ""
    ref_arg: str = ""
    struct_fields: tuple[StructField, ...] = ()
    label: str = ""          # the frame events carry, where the symbol is no name to show (C++)
    # derived: value slot of each C argument (dim3 takes two)
    slots: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def event_name(self) -> str:
        return self.label or self.symbol

    @property
    def library_re(self) -> re.Pattern[str]:
        return re.compile(self.library)

    def bpf_spec(self) -> SlSpec:
        s = SlSpec()
        s.nargs = sum(2 if t == "dim3" else 1 for _, t in self.args)
        s.flags = (SL_F_RETURN if self.ret else 0) | (SL_F_STACK if self.stack else 0) | (
            SL_F_NAME if self.kind == "name" else 0)
        s.blob_arg = -1
        s.out_arg = self.slots[self.out] if self.out else -1
        s.str_arg = self.slots[self.name_arg] if self.name_arg else -1
        s.ref_arg = self.slots[self.ref_arg] if self.ref_arg else -1
        for i in range(SL_NARGS):
            s.src[i] = 255
        for i in range(s.nargs):
            s.src[i] = i  # ABI slot i: register i (< 6) or stack slot i - 6 (src 6 + k)
        for name, t in self.args:
            if t not in SCALARS and t != "dim3":
                s.blob_arg = self.slots[name]
        return s

    def decode(self, args, blob: bytes) -> dict[str, int]:
        """Event argument values -> {name: value}; dim3 and structs are flattened to fields."""
        return self.decoder()(args, blob)

    def decoder(self):
        """The compiled `decode` function (args, blob) -> dict, cached per probe shape."""
        fn = _DECODERS.get(self.index_key)
        if fn is None:
            fn = _DECODERS[self.index_key] = self._compile_decoder()
        return fn

    @property
    def index_key(self) -> tuple:
        return (self.symbol, self.args, self.struct_fields)

    def _compile_decoder(self):
        """One dict display per probe, generated from the spec (the loader's hot path: a
        generic loop over fields cost ~3x more per event)."""
        items = []
        for name, t in self.args:
            i = self.slots[name]
            if t == "dim3":
                items += [f"{name + '_x'!r}: a[{i}] & {_MASK32}", f"{name + '_y'!r}: (a[{i}] >> 32) & {_MASK32}",
                          f"{name + '_z'!r}: a[{i + 1}] & {_MASK32}"]
            elif t in ("u32", "memcpy_kind"):
                items.append(f"{name!r}: a[{i}] & {_MASK32}")
            elif t == "i32":
                items.append(f"{name!r}: _i32(a[{i}])")
            else:
                items.append(f"{name!r}: a[{i}]")
                if t not in SCALARS:
                    for f in self.struct_fields:
                        size = 4 if f.type in ("u32", "i32") else 8
                        items.append(f"{f.name!r}: _fb(b[{f.offset}:{f.offset + size}], 'little')")
        src = "lambda a, b: {" + ", ".join(items) + "}"
        return eval(src, {"_i32": _i32, "_fb": int.from_bytes})  # noqa: S307 - text built above from the spec


def _i32(v: int) -> int:
    v &= _MASK32
    return v - (1 << 32) if v & 0x80000000 else v


_DECODERS: dict[tuple, object] = {}


def _parse_struct(name: str, table: dict) -> tuple[StructField, ...]:
    fields = []
    for item in table.get("fields", []):
        m = re.fullmatch(r"(\w+):(\w+)@(\d+)", item)
        if not m:
            raise InputError(f"probes.toml: struct {name} field {item!r} is not 'name:type@offset'")
        f = StructField(m.group(1), m.group(2), int(m.group(3)))
        if f.offset + (4 if f.type in ("u32", "i32") else 8) > SL_BLOB:
            raise InputError(f"probes.toml: struct {name} field {f.name} lies past the {SL_BLOB}-byte copy")
        fields.append(f)
    return tuple(fields)


def load_specs(path: Path | str = DEFAULT_SPEC) -> list[ProbeSpec]:
    """Parse probes.toml; raise InputError naming the entry that is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"cannot read probe spec {path}: {e}") from e
    structs = {n: _parse_struct(n, t) for n, t in data.get("structs", {}).items()}
    specs = []
    for idx, p in enumerate(data.get("probe", [])):
        where = f"probes.toml probe #{idx} ({p.get('symbol', '?')})"
        try:
            args = tuple(tuple(a.split(":", 1)) for a in p.get("args", []))
        except ValueError as e:
            raise InputError(f"{where}: args must be 'name:type'") from e
        if p.get("kind") not in KINDS:
            raise InputError(f"{where}: kind must be one of {sorted(KINDS)}")
        slots: dict[str, int] = {}
        n = 0
        struct_fields: tuple[StructField, ...] = ()
        for name, t in args:
            if t not in SCALARS and t != "dim3":
                if t not in structs:
                    raise InputError(f"{where}: unknown type {t!r} (define it under [structs.{t}])")
                if struct_fields:
                    raise InputError(f"{where}: at most one struct argument per probe")
                struct_fields = structs[t]
            slots[name] = n
            n += 2 if t == "dim3" else 1
        if n > SL_NARGS or n - 6 > 8:
            raise InputError(f"{where}: {n} argument slots, at most {SL_NARGS} are decoded")
        for ref in ("kernel", "out", "name_arg", "ref_arg", "bytes", "direction_arg"):
            if p.get(ref) and p[ref] not in slots:
                raise InputError(f"{where}: {ref} = {p[ref]!r} is not one of its args")
        specs.append(ProbeSpec(
            index=idx, library=p["library"], symbol=p["symbol"], kind=p["kind"], args=args,
            ret=bool(p.get("return", False)), stack=bool(p.get("stack", True)),
            kernel=p.get("kernel", ""), kernel_from=p.get("kernel_from", "handle"),
            bytes_arg=p.get("bytes", ""), direction=p.get("direction", ""),
            direction_arg=p.get("direction_arg", ""), out=p.get("out", ""),
            name_arg=p.get("name_arg", ""), ref_arg=p.get("ref_arg", ""),
            struct_fields=struct_fields, label=p.get("label", ""), slots=slots))
    return specs


# ---------------------------------------------------------------- exported versions of a symbol
# Drivers keep one export per ABI of a call: cuda.h #defines cuCtxSynchronize to
# cuCtxSynchronize_v2 (CUDA 13), cuMemcpyHtoD to cuMemcpyHtoD_v2 (since 3.2: 64-bit pointers), and
# with per-thread default streams to cuMemcpyHtoD_v2_ptds / cuLaunchKernel_ptsz (HIP: _spt).
# The program calls whichever its headers named, so a probe attaches to every export of its call:
# NAME[_vN][_ptds|_ptsz|_spt] with N >= the probe's own version (unversioned = 1). An older
# version (cuMemcpyHtoD next to a cuMemcpyHtoD_v2 probe) is a different ABI (32-bit pointers and
# sizes) and is left alone. A newer version is assumed to keep the arguments the probe reads;
# where one does not, give it its own [[probe]]: a probe whose symbol is the exact name claims it.
_VERSIONED = re.compile(r"(?P<base>\w+?)(?:_v(?P<v>\d+))?(?P<pt>_ptds|_ptsz|_spt)?")


def split_version(name: str) -> tuple[str, int, str]:
    """'cuMemcpyHtoD_v2_ptds' -> ('cuMemcpyHtoD', 2, '_ptds'); unversioned names are version 1."""
    m = _VERSIONED.fullmatch(name)
    if m is None:
        return name, 1, ""
    return m["base"], int(m["v"] or 1), m["pt"] or ""


@dataclass(frozen=True)
class ProbeSite:
    """One attach point: a probe spec at one exported symbol of a library."""
    spec: ProbeSpec
    export: str   # the symbol as the library exports it
    offset: int   # file offset of its code


@dataclass(frozen=True)
class Resolution:
    sites: tuple[ProbeSite, ...]
    missing: tuple[str, ...]                   # probe symbols with no export in this library
    aliases: tuple[tuple[str, str], ...] = ()  # (export, export whose code it shares): attached once

    def summary(self) -> str:
        """The probes attached to exports other than their own name, e.g.
        'cuCtxSynchronize -> cuCtxSynchronize, cuCtxSynchronize_v2'; '' when there are none."""
        by: dict[str, list[str]] = {}
        for s in self.sites:
            by.setdefault(s.spec.symbol, []).append(s.export)
        return "; ".join(f"{p} -> {', '.join(e)}" for p, e in by.items() if e != [p])


def resolve_exports(specs: list[ProbeSpec], exports: Mapping[str, int]) -> Resolution:
    """Probe sites for one library: `exports` maps its function symbols to file offsets.

    Each export goes to at most one probe: the probe named exactly so, else the closest older
    version among those it matches (cuMemAlloc_v3 goes to a cuMemAlloc_v2 probe before a
    cuMemAlloc one). Exports sharing one address are attached once, the probe's own name first,
    so no call is counted twice."""
    by_base: dict[str, list[tuple[ProbeSpec, int, str]]] = {}
    for s in specs:
        base, v, pt = split_version(s.symbol)
        by_base.setdefault(base, []).append((s, v, pt))
    exact = {s.symbol: s for s in specs}
    claimed: dict[str, ProbeSpec] = {}
    for name in exports:
        spec = exact.get(name)
        if spec is None:
            base, v, pt = split_version(name)
            fits = [(sv, bool(spt), s) for s, sv, spt in by_base.get(base, ()) if sv <= v and spt in ("", pt)]
            if not fits:
                continue
            spec = max(fits, key=lambda f: f[:2])[2]
        claimed[name] = spec
    order = {s.index: i for i, s in enumerate(specs)}
    names = sorted(claimed, key=lambda n: (order[claimed[n].index], n != claimed[n].symbol, n))
    sites: list[ProbeSite] = []
    aliases: list[tuple[str, str]] = []
    at: dict[int, str] = {}
    for name in names:
        off = exports[name]
        if off in at:
            aliases.append((name, at[off]))
            continue
        at[off] = name
        sites.append(ProbeSite(claimed[name], name, off))
    found = {s.spec.index for s in sites}
    return Resolution(tuple(sites), tuple(s.symbol for s in specs if s.index not in found), tuple(aliases))


_RESOLVED: dict[tuple, Resolution] = {}
_RESOLVED_MAX = 64


def resolve_library(path: str | Path, specs: list[ProbeSpec]) -> Resolution:
    """`resolve_exports` over the function symbols of the ELF file at `path` (.dynsym, then
    .symtab for stripped-of-dynsym test builds; the first definition of a name wins). Kept per
    file (path, inode, mtime, size) and probe list: a daemon reads libtorch_cpu's 200k symbols
    (0.44 s on the 2-vCPU machine) once, not at every attach."""
    from stacklens.introspect.elf import SHT_DYNSYM, SHT_SYMTAB, ElfFile

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size,
           tuple((sp.index, sp.symbol) for sp in specs))
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    bases = tuple({split_version(s.symbol)[0].encode() for s in specs})
    common = os.path.commonprefix(list(bases)) or None   # checked on the raw bytes: fewer decoded
    exports: dict[str, int] = {}
    with ElfFile(path) as elf:
        for name, value, _ in elf.iter_symbols((SHT_DYNSYM, SHT_SYMTAB), name_filter=common):
            if name in exports or not name.encode().startswith(bases):
                continue
            off = elf.vaddr_to_offset(value)
            if off is not None:
                exports[name] = off
    res = resolve_exports(specs, exports)
    if len(_RESOLVED) >= _RESOLVED_MAX:
        _RESOLVED.clear()
    _RESOLVED[key] = res
    return res

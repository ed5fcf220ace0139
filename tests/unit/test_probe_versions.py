"""Which exports each probe attaches to (bpf/spec.py resolve_exports), on libcuda's export list."""

from __future__ import annotations

from stacklens.bpf.spec import load_specs, resolve_exports, split_version

# driver API exports around the probed calls as `nm -D libcuda.so.1` lists them on driver 5xx
# (580 adds cuCtxSynchronize_v2), with neighbours that must not be taken for them
LIBCUDA = """
cuCtxSynchronize cuCtxSynchronize_v2 cuCtxCreate cuCtxCreate_v2 cuCtxCreate_v3 cuCtxCreate_v4
cuStreamSynchronize cuStreamSynchronize_ptsz cuEventSynchronize cuEventRecord cuEventRecord_ptsz
cuLaunchKernel cuLaunchKernel_ptsz cuLaunchKernelEx cuLaunchKernelEx_ptsz cuLaunchCooperativeKernel
cuLaunchCooperativeKernel_ptsz cuLaunchHostFunc cuGraphLaunch cuGraphLaunch_ptsz
cuMemAlloc cuMemAlloc_v2 cuMemAllocHost cuMemAllocHost_v2 cuMemAllocAsync cuMemAllocAsync_ptsz
cuMemFree cuMemFree_v2 cuMemFreeAsync cuMemFreeAsync_ptsz cuMemFreeHost
cuMemcpy cuMemcpy_ptds cuMemcpyAsync cuMemcpyAsync_ptsz cuMemcpyPeer cuMemcpy2D_v2
cuMemcpyHtoD cuMemcpyHtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyDtoH cuMemcpyDtoH_v2 cuMemcpyDtoH_v2_ptds
cuMemcpyDtoD cuMemcpyDtoD_v2 cuMemcpyDtoD_v2_ptds cuMemcpyHtoDAsync cuMemcpyHtoDAsync_v2
cuMemcpyHtoDAsync_v2_ptsz cuMemcpyDtoHAsync cuMemcpyDtoHAsync_v2 cuMemcpyDtoHAsync_v2_ptsz
cuMemcpyDtoDAsync cuMemcpyDtoDAsync_v2 cuMemcpyDtoDAsync_v2_ptsz
cuModuleGetFunction cuLibraryGetKernel cuKernelGetFunction cuGetProcAddress cuGetProcAddress_v2
cuMemsetD8 cuMemsetD8_v2 cuMemsetD8_v2_ptds cuMemsetD16 cuMemsetD16_v2 cuMemsetD32 cuMemsetD32_v2
cuMemsetD32_v2_ptds cuMemsetD8Async cuMemsetD8Async_ptsz cuMemsetD16Async cuMemsetD16Async_ptsz
cuMemsetD32Async cuMemsetD32Async_ptsz cuMemsetD2D8_v2
cuStreamBeginCapture cuStreamBeginCapture_ptsz cuStreamBeginCapture_v2 cuStreamBeginCapture_v2_ptsz
cuStreamBeginCaptureToGraph cuStreamEndCapture cuStreamEndCapture_ptsz
""".split()
CUDA_SPECS = [s for s in load_specs() if "libcuda" in s.library]


def _sites(specs, names):
    res = resolve_exports(specs, {n: 0x1000 + 16 * i for i, n in enumerate(names)})
    return res, {s.export: s.spec.symbol for s in res.sites}


def test_split_version():
    assert split_version("cuMemcpyHtoD_v2_ptds") == ("cuMemcpyHtoD", 2, "_ptds")
    assert split_version("cuLaunchKernel_ptsz") == ("cuLaunchKernel", 1, "_ptsz")
    assert split_version("cuCtxSynchronize") == ("cuCtxSynchronize", 1, "")
    assert split_version("hipMemcpy_spt") == ("hipMemcpy", 1, "_spt")


def test_each_probe_takes_its_call_s_exports_on_libcuda():
    res, sites = _sites(CUDA_SPECS, LIBCUDA)
    assert res.missing == ()
    want = {
        "cuCtxSynchronize": "cuCtxSynchronize", "cuCtxSynchronize_v2": "cuCtxSynchronize",
        "cuStreamSynchronize_ptsz": "cuStreamSynchronize", "cuLaunchKernel_ptsz": "cuLaunchKernel",
        "cuLaunchKernelEx_ptsz": "cuLaunchKernelEx", "cuGraphLaunch_ptsz": "cuGraphLaunch",
        "cuLaunchCooperativeKernel_ptsz": "cuLaunchCooperativeKernel",
        "cuMemAllocAsync_ptsz": "cuMemAllocAsync", "cuMemFreeAsync_ptsz": "cuMemFreeAsync",
        "cuMemcpy_ptds": "cuMemcpy", "cuMemcpyAsync_ptsz": "cuMemcpyAsync",
        "cuMemcpyHtoD_v2_ptds": "cuMemcpyHtoD_v2", "cuMemcpyDtoHAsync_v2_ptsz": "cuMemcpyDtoHAsync_v2",
        "cuStreamBeginCapture_v2": "cuStreamBeginCapture", "cuStreamBeginCapture_v2_ptsz": "cuStreamBeginCapture",
        "cuStreamEndCapture_ptsz": "cuStreamEndCapture",
    }
    for export, probe in want.items():
        assert sites[export] == probe, export
    # older ABIs (32-bit pointers and sizes) and other calls of a similar name are left alone
    for other in ("cuMemAlloc", "cuMemFree", "cuMemcpyHtoD", "cuMemcpyDtoHAsync", "cuMemAllocHost_v2",
                  "cuMemcpyPeer", "cuMemcpy2D_v2", "cuEventRecord_ptsz", "cuCtxCreate_v2", "cuGetProcAddress_v2",
                  "cuStreamBeginCaptureToGraph"):
        assert other not in sites, other
    # every probe on its own name where exported, once per export
    assert all(sites.get(s.symbol) == s.symbol for s in CUDA_SPECS)
    assert len(res.sites) == len(sites)
    assert "cuCtxSynchronize -> cuCtxSynchronize, cuCtxSynchronize_v2" in res.summary()


def test_a_probe_named_exactly_claims_its_export():
    specs = load_specs()
    ptsz = next(s for s in specs if s.symbol == "cuStreamSynchronize")
    own = type(ptsz)(**{**ptsz.__dict__, "index": 99, "symbol": "cuStreamSynchronize_ptsz"})
    _, sites = _sites(CUDA_SPECS + [own], LIBCUDA)
    assert sites["cuStreamSynchronize_ptsz"] == "cuStreamSynchronize_ptsz"
    assert sites["cuStreamSynchronize"] == "cuStreamSynchronize"


def test_a_newer_version_goes_to_the_closest_probe_and_aliases_attach_once():
    res = resolve_exports(CUDA_SPECS, {"cuMemAlloc_v2": 0x100, "cuMemAlloc_v3": 0x200,
                                       "cuCtxSynchronize": 0x300, "cuCtxSynchronize_v2": 0x300})
    assert {(s.spec.symbol, s.export) for s in res.sites} == {
        ("cuMemAlloc_v2", "cuMemAlloc_v2"), ("cuMemAlloc_v2", "cuMemAlloc_v3"), ("cuCtxSynchronize", "cuCtxSynchronize")}
    assert res.aliases == (("cuCtxSynchronize_v2", "cuCtxSynchronize"),)


def test_hip_per_thread_exports():
    hip = [s for s in load_specs() if "amdhip" in s.library]
    _, sites = _sites(hip, ["hipMemcpy", "hipMemcpy_spt", "hipStreamSynchronize_spt", "hipLaunchKernel_spt"])
    assert sites == {"hipMemcpy": "hipMemcpy", "hipMemcpy_spt": "hipMemcpy",
                     "hipStreamSynchronize_spt": "hipStreamSynchronize", "hipLaunchKernel_spt": "hipLaunchKernel"}

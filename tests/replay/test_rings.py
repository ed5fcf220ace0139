"""Recorded rings through the RingDecoder, without root (tests/data/rings/README.md): what the
live decoder returned while recording, and what the targets are known to do."""

from __future__ import annotations

from collections import Counter

import pytest

from stacklens.bpf.decode import TRUNCATED, RecordList
from tests.replay.rings import as_lists, load


def decode(name: str):
    ring = load(name)
    return ring, ring.decoder.decode(RecordList(ring.records), 1 << 30)


@pytest.mark.parametrize("name", ["named_loop", "fake_cuda"])
def test_a_replay_decodes_what_the_live_decoder_did(name):
    ring, evs = decode(name)
    assert [as_lists(e) for e in evs] == ring.live["events"]
    assert ring.decoder.counts == ring.live["counts"]
    assert ring.decoder.counts["records_undecodable"] == ring.decoder.counts["py_stacks_undecodable"] == 0
    assert all(e.pid == ring.pid for e in evs)


def test_cpu_samples_of_a_python_loop_name_its_frames():
    """named_loop.py under the launcher of record.py (`<string>`), its hot function exec'd as
    `replay_hot_loop` (`<string>` too): every sample is in the loop, outermost first."""
    ring, evs = decode("named_loop")
    assert Counter(e.kind for e in evs) == {"cpu_sample": 90}
    outer = [("<string>", "<module>", 11), ("tests/targets/named_loop.py", "<module>", 39),
             ("tests/targets/named_loop.py", "main_loop", 30)]     # main_loop's `fn(20_000)`
    for e in evs:
        frames = [(f.file, f.name, f.line) for f in e.py_stack]
        assert all(f.kind == "python" for f in e.py_stack)
        assert frames[:3] == outer and len(frames) == 4
        assert frames[3][:2] == ("<string>", "replay_hot_loop") and frames[3][2] in (3, 4)   # the loop's body
        assert e.py_entries == (True, True, False, False)     # eval-loop entries: the launcher's and the exec's
    leaf_lines = Counter(e.py_stack[-1].line for e in evs)
    assert leaf_lines == {4: 60, 3: 30}
    # native frames: the interpreter's own (libpython built without frame pointers: the walk is cut)
    for e in evs:
        assert e.native_stack[0] == TRUNCATED and len(e.native_stack) >= 2
        assert all(f.kind == "native" and f.file == "libpython3.11.so.1.0" for f in e.native_stack[1:])
    leaves = Counter(e.native_stack[-1].name for e in evs)
    assert leaves["_PyEval_EvalFrameDefault"] == 31 and leaves["_PyObject_Free"] == 16
    assert ring.decoder.counts["py_stacks_symbolized"] == 7    # one symbolization per distinct stack id


def test_fake_cuda_calls_decode_with_kernels_sizes_directions_and_both_stacks():
    """fake_cuda_app.py 7 5: forward(7) and backward(5) launches, 3 cuLaunchKernelEx, an alloc,
    four copies, the free and a sync; kernel names come from the name events of the same ring."""
    ring, evs = decode("fake_cuda")
    assert Counter(e.kind for e in evs) == {"launch": 15, "memcpy": 4, "alloc": 1, "free": 1, "sync": 1}
    launches = [e for e in evs if e.api == "cuLaunchKernel"]
    assert Counter(e.kernel_name for e in launches) == {"fwd_kernel": 7, "bwd_kernel": 5}
    assert [e.kernel_name for e in evs if e.api == "cuLaunchKernelEx"] == ["fwd_kernel"] * 3
    fwd = next(e for e in launches if e.kernel_name == "fwd_kernel")
    assert {k: fwd.args[k] for k in ("grid_x", "grid_y", "block_x", "shared_mem", "stream")} == {
        "grid_x": 64, "grid_y": 2, "block_x": 256, "shared_mem": 1024, "stream": 0x5151}
    copies = [(e.api, e.bytes, e.direction) for e in evs if e.kind == "memcpy"]
    assert copies == [("cuMemcpyHtoD_v2", 4096, "HtoD"), ("cuMemcpyDtoH_v2", 8192, "DtoH"),
                      ("cuMemcpyDtoD_v2", 512, "DtoD"), ("cuMemcpyHtoDAsync_v2", 256, "HtoD")]
    alloc, free = (next(e for e in evs if e.kind == k) for k in ("alloc", "free"))
    assert alloc.bytes == free.bytes == 1 << 20 and alloc.args["ptr"] != 0   # the free's size from the alloc
    app = "tests/targets/fake_cuda_app.py"
    caller = {"fwd_kernel": ("forward", 36), "bwd_kernel": ("backward", 40)}
    for e in launches:
        assert [(f.file, f.name, f.line) for f in e.py_stack][1:] == [(app, "<module>", 62 if e.kernel_name == "fwd_kernel"
                                                                       else 63), (app, *caller[e.kernel_name])]
        names = [f.name for f in e.native_stack]
        assert names[-1] == "cuLaunchKernel" and e.native_stack[-1].file == "libcuda.so.1"
        assert ("app_forward_launches" if e.kernel_name == "fwd_kernel" else "app_backward_launches") in names
    sync = next(e for e in evs if e.kind == "sync")
    assert (sync.py_stack[-1].file, sync.py_stack[-1].name, sync.py_stack[-1].line) == (app, "sync", 55)
    assert sync.native_stack[-1] == ("native", "cuStreamSynchronize", "libcuda.so.1", 0)


def test_a_python_stack_id_is_symbolized_once_and_code_objects_read_once():
    """The second replay of the same records on the same decoder reads nothing new: every stack
    and Python stack comes from the decoder's caches."""
    ring, first = decode("fake_cuda")
    mem = ring.decoder.py.mem
    reads = mem.reads
    mem.reads = {}                         # any read now would raise: nothing may be read again
    again = ring.decoder.decode(RecordList(ring.records), 1 << 30)
    assert again == first and [e.py_stack for e in again] == [e.py_stack for e in first]
    assert ring.decoder.counts["py_stacks_symbolized"] == 10 and reads

"""The join stage: BPF events and the agent's GPU records become one calling context tree.

- joiner.py: the Joiner (one per session, its aggregation thread's): routes BPF events and agent
  records, keeps the window bookkeeping and takes snapshots; it composes
- paths.py: the path of a BPF event (native frames spliced into Python stacks, memoized);
- charges.py: GPU records charged to the tree where the GPU join says (kernels, copies, JAX splits);
- stats.py: what the join counts, and the notes it leaves in a profile's meta; and it drives:
- gpujoin.py: the GPU join's interface (GpuJoin, its verdicts through Charges), with two equal
  implementations chosen at session start from the GPU vendor's declaration (inject/channel/gpu):
  apijoin.py (by CUPTI API records) and orderjoin.py (by launch order);
- jaxjoin.py: JAX's HLO ops, a splitter of kernels GpuCharges calls;
- backward.py: the backward link, autograd nodes back to the forward op that created them.
- rename.py: in snapshots, launches counted on `kernel:unresolved:0x…` before the kernel's name was
  learnt moved onto the named kernel; the launches never named said once in the notes.

Pure: no bcc, grpc, textual or ctypes (import-linter contract in pyproject.toml).
"""

"""The join stage: BPF events and the agent's GPU records become one calling context tree.

- joiner.py: the Joiner (one per session, its aggregation thread's): splices native frames into
  Python stacks, builds paths, charges metrics to the tree, and drives:
- gpujoin.py: the GPU join's interface (GpuJoin, its verdicts through Charges), with two equal
  implementations chosen at session start from the GPU vendor's declaration (inject/channel/gpu):
  apijoin.py (by CUPTI API records) and orderjoin.py (by launch order);
- jaxjoin.py: JAX's HLO ops, a splitter of kernels the Joiner calls;
- backward.py: the backward link, autograd nodes back to the forward op that created them.
- rename.py: in snapshots, launches counted on `kernel:unresolved:0x…` before the kernel's name was
  learnt moved onto the named kernel; the launches never named said once in the notes.

Pure: no bcc, grpc, textual or ctypes (import-linter contract in pyproject.toml).
"""

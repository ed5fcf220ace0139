/* fake_nosyms.c — a library named libcuda.so.1 that exports none of the probed symbols. */
__attribute__((visibility("default"))) int cuSomethingElse(int x) { return x + 1; }

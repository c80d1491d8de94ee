"""A parallel-layout fuzzer: random valid compositions of the parallelisms, each equal to one
process (docs/guide/fuzzing.md)."""

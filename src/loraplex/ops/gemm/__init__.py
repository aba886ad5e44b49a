"""The projections' GEMM: a Triton kernel for decode-sized batches on GPUs, cuBLAS otherwise."""

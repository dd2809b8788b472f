"""The worker's hot-path kernels: attention over the paged KV cache, KV stores, RMSNorm and
rotary embedding, each as a Triton kernel with a torch reference. `kernels.ops` puts them
behind one interface; `bench.kernels` checks and times them."""

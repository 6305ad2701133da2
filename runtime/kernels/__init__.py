"""Triton kernels of the runtime: quantized products that read GGUF blocks as stored
(``qmatvec``) and the fused mixture-of-experts decode path (``moe_experts``)."""

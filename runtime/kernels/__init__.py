"""Triton kernels of the runtime: quant blocks read as stored (``blocks``), the dense projections
(``dense``), the fused mixture-of-experts paths (``moe``, ``moe_grouped``) and the fused steps
around them (norms, attention, DeltaNet, routers)."""

"""Pure data and format code: GGUF reading, architecture specs, quant block math,
the .sparkpack format and routing profiles. Nothing here imports torch, so the formats can be
inspected, split and verified on machines without it."""

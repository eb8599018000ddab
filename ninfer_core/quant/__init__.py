"""Weight formats: dense dtypes and symmetric group-quantized codes (Q4G64 ... W8G32)."""

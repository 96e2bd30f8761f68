"""Speed and memory: timing protocol (`speed`, `blocks`), measurements (`measure`), the matmul
probe (`matmul`), FLOP counts (`flops`) and the hardware description (`hardware`)."""

"""Speed and memory: timing protocol (`speed`), measurements (`measure`), the matmul probe
(`matmul`), FLOP counts (`flops`) and the phase clock (`phases`). The machine's description is `parity.core.hardware`."""

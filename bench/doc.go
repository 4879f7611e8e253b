// Package bench measures gpuctx: timing on the device with events (warm-up,
// then the median of timed runs), the two ceilings measured in the same run
// (device-to-device copy bandwidth and a large GEMM through a Context), the
// floor model of an MoE layer, the MoE layer bench (modes, rotated weight
// sets, output checks) and its peer (bench/peers/triton_fused_moe.py, run as
// a child process, alternated with gpuctx over rounds), and the GEMM bench.
// Package cmd/gpuctx holds the flags and the printing; moe never imports
// bench.
package bench

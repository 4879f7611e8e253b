#!/bin/sh
# A fake "python" for the tests of moe bench --peer: it ignores the script and
# prints canned lines shaped like bench/peers/triton_fused_moe.py's stdout.
# FAKE_PEER_ARGS=FILE records the arguments; FAKE_PEER_MODE picks the outcome:
# ok (default), check (token count 4 fails its check, exit 1), exit (no rows,
# exit 2, as when triton does not import). FAKE_PEER_SETS: the weight sets it
# says it rotated (default 1). FAKE_PEER_DTYPE: the "dtype" of its env line, as
# triton_fused_moe_fp8.py prints "fp8" (default none, as triton_fused_moe.py).
[ -n "$FAKE_PEER_ARGS" ] && echo "$@" > "$FAKE_PEER_ARGS"
envline() {
  if [ -n "$FAKE_PEER_DTYPE" ]; then
    echo "env: {\"device\": \"fake\", \"dtype\": \"$FAKE_PEER_DTYPE\"}"
  else
    echo 'env: {"device": "fake"}'
  fi
}
echo "peer progress on stderr" >&2
case "${FAKE_PEER_MODE:-ok}" in
exit)
  echo "FAIL: triton does not import: ModuleNotFoundError('triton')"
  exit 2 ;;
check)
  envline
  echo '{"tokens": 1, "preset": "deepseek-v2-lite", "floor_us": 10.0, "eager_us": 900.0, "graph_us": 60.0, "graph_dual_us": 50.0, "graph_tuned_us": 40.0, "ok_tuned": false, "compute_floor_us": 0.1, "rel_err": 0.001, "ok": true}'
  echo 'FAIL T=4: rel err 0.5 >= 0.02 or check failed'
  echo '{"tokens": 4, "preset": "deepseek-v2-lite", "floor_us": 10.0, "eager_us": 900.0, "graph_us": 70.0, "graph_dual_us": null, "rel_err": 0.5, "ok": false}'
  echo "FAIL: primary config failed at 1 of 2 token counts; other configs failed 0 time(s); 1 s total"
  exit 1 ;;
*)
  envline
  echo "weights: ${FAKE_PEER_SETS:-1} set(s) of 0.01 GB (rotated to defeat L2)"
  echo '{"tokens": 1, "preset": "deepseek-v2-lite", "floor_us": 10.0, "active_experts": 5.5, "eager_us": 900.0, "graph_us": 60.0, "graph_dual_us": 50.0, "graph_tuned_us": 45.0, "ok_tuned": true, "compute_floor_us": 0.1, "rel_err": 0.001, "ok": true}'
  echo '{"tokens": 4, "preset": "deepseek-v2-lite", "floor_us": 10.0, "eager_us": 950.0, "graph_us": 80.0, "graph_dual_us": 90.0, "compute_floor_us": 0.4, "rel_err": 0.001, "ok": true}'
  echo "PASS: primary config failed at 0 of 2 token counts; other configs failed 0 time(s); 1 s total" ;;
esac

#!/usr/bin/env bash
# Session 4, last GPU call (after s4_final.sh, commit 18aaae1): the
# warp-reduction top-k and the one-thread-per-output SwiGLU. s4_final.sh
# without moe run and the timeline, memcheck over the routing tests.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
NORUN=1 MEMCHECK='TestRouteAlignOneLaunch|TestRouteKernelTies' exec bash "$(dirname "$0")/s4_final.sh"

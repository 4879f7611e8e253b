#!/usr/bin/env bash
# Session 5, last GPU call of the merged tree: s4_final.sh without moe run,
# the timeline and ncu; memcheck over the routing tests and the persistent
# tiles. Every CUDA test binary, then the three presets against the Triton
# peer in the same invocation.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
NORUN=1 NONCU=1 MEMCHECK='TestRouteAlignOneLaunch|TestRouteKernelTies|TestLayerFusedTiles/cuda/m128n(128|256)k64g2s4p4' exec bash "$(dirname "$0")/s4_final.sh"

"""The checkpoint engine: non-reentrant saved-tensor hooks, the reentrant C++ Function, state replay."""

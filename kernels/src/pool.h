// One persistent pool of worker threads for the kernels, sized to the machine's cores.
#pragma once

#include <functional>

namespace mlxgate {

// Runs task(i) for i in [0, tasks) on the pool's workers and the calling thread, and returns
// when all are done. Workers spin briefly between calls (a decode step makes hundreds of
// calls a few microseconds apart), then sleep, so an idle server uses no CPU.
void parallel_for(int tasks, const std::function<void(int)>& task);

// How many threads parallel_for uses, the caller's included.
int pool_threads();

}  // namespace mlxgate

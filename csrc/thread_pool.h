// A small process-wide pool of persistent worker threads for splitting one blocking call
// (a large memcpy, a cuFile transfer) over several cores, without starting a thread per call.
#pragma once
#include <functional>

namespace fastckpt {

// Runs part(0) .. part(parts - 1): part 0 on the calling thread, the others on the pool's
// workers (or on the caller where no worker can be had). Returns once every part has
// finished; then rethrows the first exception a part threw, if any.
void run_parts(unsigned parts, const std::function<void(unsigned)>& part);

}  // namespace fastckpt

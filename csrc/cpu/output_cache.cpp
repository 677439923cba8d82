// The output cache of output_cache.h.
#include "output_cache.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <mutex>
#include <vector>

namespace specdec {
namespace cpu {
namespace {

// Smaller outputs are left to the default allocator (malloc keeps them without faulting).
constexpr size_t kMinBytes = size_t{4} << 20;
// Capacities are rounded up to this, so rows of slightly different counts share blocks.
constexpr size_t kRounding = size_t{2} << 20;
// Freed blocks kept: a decoding loop alternates between a few output shapes at most.
constexpr size_t kMaxKept = 2;

struct Block {
  void* data;
  size_t capacity;
};

class OutputCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return c10::GetCPUAllocator()->allocate(n);
    const size_t capacity = (n + kRounding - 1) / kRounding * kRounding;
    Block* block = take(capacity);
    if (block == nullptr) block = new Block{c10::alloc_cpu(capacity), capacity};
    return {block->data, block, &OutputCache::give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static OutputCache& instance() {
    // Never destroyed: outputs may be freed after static destructors have run.
    static OutputCache* cache = new OutputCache();
    return *cache;
  }

 private:
  // The smallest kept block that holds `capacity` bytes without wasting more than half of it.
  Block* take(size_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t best = kept_.size();
    for (size_t i = 0; i < kept_.size(); ++i) {
      const size_t c = kept_[i]->capacity;
      if (c >= capacity && c <= 2 * capacity && (best == kept_.size() || c < kept_[best]->capacity)) best = i;
    }
    if (best == kept_.size()) return nullptr;
    Block* b = kept_[best];
    kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
    return b;
  }

  static void give_back(void* ctx) {
    Block* b = static_cast<Block*>(ctx);
    Block* evicted = nullptr;
    OutputCache& cache = instance();
    {
      std::lock_guard<std::mutex> lock(cache.mutex_);
      cache.kept_.push_back(b);
      if (cache.kept_.size() > kMaxKept) {  // the oldest goes back to the system
        evicted = cache.kept_.front();
        cache.kept_.erase(cache.kept_.begin());
      }
    }
    if (evicted != nullptr) {
      c10::free_cpu(evicted->data);
      delete evicted;
    }
  }

  std::mutex mutex_;
  std::vector<Block*> kept_;  // oldest first
};

}  // namespace

at::Tensor empty_reused_output(c10::IntArrayRef sizes) {
  return at::detail::empty_generic(sizes, &OutputCache::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   at::kFloat, std::nullopt);
}

}  // namespace cpu
}  // namespace specdec

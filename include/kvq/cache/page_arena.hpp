#pragma once
/// \file page_arena.hpp
/// One layer's pages: fixed-size, 64-byte aligned byte pages carved from a few large chunks.
/// Pages never move once allocated (an engine or a kernel may hold their pointers until the
/// cache drops them), the page table is a plain array of pointers, and growth is geometric
/// (each new chunk holds half the current capacity, at least one page), so a decode loop
/// allocates only when it outgrows the capacity, never per token; reserve() allocates up
/// front. Chunks are zero-filled when allocated, so the alignment padding of every page is
/// zero and two caches holding the same tokens hold the same page bytes.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/layout/page_layout.hpp"

namespace kvq {

class PageArena {
 public:
  PageArena() = default;
  explicit PageArena(std::size_t page_bytes) : page_bytes_(page_bytes) {}
  PageArena(const PageArena& o) : page_bytes_(o.page_bytes_) {
    reserve(o.used_);
    for (std::size_t i = 0; i < o.used_; ++i) std::memcpy(slots_[i], o.slots_[i], page_bytes_);
    used_ = o.used_;
  }
  PageArena& operator=(const PageArena& o) {
    if (this != &o) {
      PageArena t(o);
      swap(t);
    }
    return *this;
  }
  PageArena(PageArena&&) noexcept = default;
  PageArena& operator=(PageArena&&) noexcept = default;
  void swap(PageArena& o) noexcept {
    std::swap(page_bytes_, o.page_bytes_);
    chunks_.swap(o.chunks_);
    slots_.swap(o.slots_);
    std::swap(used_, o.used_);
  }

  std::size_t page_bytes() const { return page_bytes_; }
  /// Pages in use: [0, size()).
  std::size_t size() const { return used_; }
  /// Pages allocated (in use or free).
  std::size_t capacity() const { return slots_.size(); }
  /// Page i (i < capacity(): pages past size() are free slots a writer may fill before
  /// publishing them with resize()).
  std::byte* page(std::size_t i) const { return slots_[i]; }
  /// The page table: capacity() pointers, the first size() in use.
  const std::byte* const* table() const {
    return reinterpret_cast<const std::byte* const*>(slots_.data());
  }
  /// Makes pages [0, n) the pages in use (n <= capacity(); no allocation, no throw).
  void resize(std::size_t n) { used_ = std::min(n, slots_.size()); }

  /// Ensures capacity() >= pages; allocates one chunk when it grows (may throw bad_alloc,
  /// changing nothing). Exact: reserve(n) on an empty arena allocates n pages.
  void reserve(std::size_t pages) {
    if (pages <= slots_.size()) return;
    add_chunk(pages - slots_.size());
  }
  /// Ensures room for `pages` pages, growing geometrically (half the capacity, at least the
  /// missing pages) so repeated growth costs O(log n) allocations.
  void grow_for(std::size_t pages) {
    if (pages <= slots_.size()) return;
    add_chunk(std::max(pages - slots_.size(), std::max<std::size_t>(1, slots_.size() / 2)));
  }

  /// Bytes allocated for pages (capacity x page bytes) and for the page table.
  std::size_t allocated_bytes() const {
    return slots_.size() * page_bytes_ + slots_.capacity() * sizeof(std::byte*) +
           chunks_.capacity() * sizeof(Chunk);
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete(p, std::align_val_t(kPageAlign)); }
  };
  using Chunk = std::unique_ptr<std::byte, Free>;

  void add_chunk(std::size_t pages) {
    KVQ_REQUIRE(page_bytes_ > 0 && page_bytes_ % kPageAlign == 0, kInvalidArgument,
                "PageArena: page size ", page_bytes_, " is not a positive multiple of ", kPageAlign);
    KVQ_REQUIRE(pages <= SIZE_MAX / page_bytes_, kOutOfRange, "PageArena: ", pages,
                " pages of ", page_bytes_, " bytes do not fit in memory");
    slots_.reserve(slots_.size() + pages);  // first: nothing below may fail after the chunk
    chunks_.reserve(chunks_.size() + 1);
    Chunk c(static_cast<std::byte*>(::operator new(pages * page_bytes_, std::align_val_t(kPageAlign))));
    std::memset(c.get(), 0, pages * page_bytes_);
    for (std::size_t i = 0; i < pages; ++i) slots_.push_back(c.get() + i * page_bytes_);
    chunks_.push_back(std::move(c));
  }

  std::size_t page_bytes_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<std::byte*> slots_;
  std::size_t used_ = 0;
};

}  // namespace kvq

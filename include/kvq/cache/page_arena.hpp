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
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/layout/page_layout.hpp"

namespace kvq {

/// Where an engine's pages come from: its own pool (GPU-pinned memory, a shared block pool,
/// a mapped file). kvq asks for one page at a time and gives every page back exactly once.
/// KVCacheOptions::page_allocator puts a KVCache's pages there (docs/cache.md, "Engine pages").
class PageAllocator {
 public:
  virtual ~PageAllocator() = default;
  /// A page of `bytes` bytes (a multiple of kPageAlign), aligned to kPageAlign. Throws when
  /// the pool is exhausted (kvq's callers then change nothing: the strong guarantee holds).
  /// kvq zero-fills the page before use.
  virtual std::byte* allocate(std::size_t bytes) = 0;
  /// Gives back a page allocate(bytes) returned.
  virtual void release(std::byte* page, std::size_t bytes) noexcept = 0;
};

class PageArena {
 public:
  PageArena() = default;
  explicit PageArena(std::size_t page_bytes) : page_bytes_(page_bytes) {}
  /// Pages from `alloc` (one allocate() per page; nullptr: kvq's own chunks). The allocator
  /// must outlive the arena and every copy of it.
  PageArena(std::size_t page_bytes, PageAllocator* alloc) : page_bytes_(page_bytes), alloc_(alloc) {}
  PageArena(const PageArena& o) : page_bytes_(o.page_bytes_), alloc_(o.alloc_) {
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
  PageArena(PageArena&& o) noexcept { swap(o); }
  PageArena& operator=(PageArena&& o) noexcept {
    if (this != &o) {
      PageArena t(std::move(o));
      swap(t);
    }
    return *this;
  }
  ~PageArena() { release_slots(0); }
  void swap(PageArena& o) noexcept {
    std::swap(page_bytes_, o.page_bytes_);
    std::swap(alloc_, o.alloc_);
    chunks_.swap(o.chunks_);
    slots_.swap(o.slots_);
    std::swap(used_, o.used_);
  }
  /// The engine's allocator, or nullptr.
  PageAllocator* allocator() const { return alloc_; }
  /// Gives the free slots (pages past size()) back to the engine's allocator; with kvq's own
  /// chunks it does nothing (a chunk is freed whole, with the arena).
  void release_unused() noexcept {
    if (alloc_) release_slots(used_);
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
  /// Takes the first n pages in use out of use (a sliding-window layer releasing its oldest
  /// pages): the pages in use keep their order and become [0, size() - n); the n pages become
  /// free slots, reused by later writers or given back by release_unused(). No page moves in
  /// memory; no allocation, no throw.
  void drop_front(std::size_t n) noexcept {
    n = std::min(n, used_);
    std::rotate(slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(n),
                slots_.begin() + static_cast<std::ptrdiff_t>(used_));
    used_ -= n;
  }

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

  void release_slots(std::size_t keep) noexcept {
    if (!alloc_) return;
    while (slots_.size() > keep) {
      alloc_->release(slots_.back(), page_bytes_);
      slots_.pop_back();
    }
    used_ = std::min(used_, keep);
  }

  void add_chunk(std::size_t pages) {
    KVQ_REQUIRE(page_bytes_ > 0 && page_bytes_ % kPageAlign == 0, kInvalidArgument,
                "PageArena: page size ", page_bytes_, " is not a positive multiple of ", kPageAlign);
    KVQ_REQUIRE(pages <= SIZE_MAX / page_bytes_, kOutOfRange, "PageArena: ", pages,
                " pages of ", page_bytes_, " bytes do not fit in memory");
    slots_.reserve(slots_.size() + pages);  // first: nothing below may fail after the chunk
    if (alloc_) {  // one page at a time from the engine; all or nothing
      const std::size_t before = slots_.size();
      try {
        for (std::size_t i = 0; i < pages; ++i) {
          std::byte* p = alloc_->allocate(page_bytes_);
          KVQ_REQUIRE(p != nullptr && reinterpret_cast<std::uintptr_t>(p) % kPageAlign == 0,
                      kInvalidArgument, "PageArena: the page allocator returned ",
                      p ? "a page not aligned to " : "no page (nullptr) for a page of ",
                      p ? kPageAlign : page_bytes_, p ? " bytes" : " bytes");
          slots_.push_back(p);
          std::memset(p, 0, page_bytes_);
        }
      } catch (...) {
        release_slots(before);
        throw;
      }
      return;
    }
    chunks_.reserve(chunks_.size() + 1);
    Chunk c(static_cast<std::byte*>(::operator new(pages * page_bytes_, std::align_val_t(kPageAlign))));
    std::memset(c.get(), 0, pages * page_bytes_);
    for (std::size_t i = 0; i < pages; ++i) slots_.push_back(c.get() + i * page_bytes_);
    chunks_.push_back(std::move(c));
  }

  std::size_t page_bytes_ = 0;
  PageAllocator* alloc_ = nullptr;
  std::vector<Chunk> chunks_;
  std::vector<std::byte*> slots_;
  std::size_t used_ = 0;
};

}  // namespace kvq

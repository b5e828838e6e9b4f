#pragma once
/// \file page_arena.hpp
/// One layer's pages: fixed-size, 64-byte aligned byte pages carved from a few large chunks.
/// Pages never move once allocated (an engine or a kernel may hold their pointers until the
/// cache drops them), the page table is a plain array of pointers, and growth is geometric
/// (each new chunk holds half the current capacity, at least one page), so a decode loop
/// allocates only when it outgrows the capacity, never per token; reserve() allocates up
/// front. Chunks are zero-filled when allocated, so the alignment padding of every page is
/// zero and two caches holding the same tokens hold the same page bytes.
///
/// Pages are reference-counted: share() gives another arena (a KVCache::fork()) the pages in
/// use without copying them. Copy-on-write needs no copy here: pages in use are never written
/// (a writer fills free slots, then publishes them), and a page that leaves use while another
/// arena holds it is dropped instead of becoming a free slot, so every free slot is held by
/// its arena alone. An engine's page goes back to its PageAllocator once, when the last arena
/// holding it drops it; kvq's own chunk is freed when no arena holds any page of it.
#include <algorithm>
#include <atomic>
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
  /// must outlive the arena, every copy of it and every arena that shares its pages.
  PageArena(std::size_t page_bytes, PageAllocator* alloc) : page_bytes_(page_bytes), alloc_(alloc) {}
  /// A deep copy: the pages in use are copied into pages of the copy's own.
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
  ~PageArena() { drop_slots(0); }
  void swap(PageArena& o) noexcept {
    std::swap(page_bytes_, o.page_bytes_);
    std::swap(alloc_, o.alloc_);
    slots_.swap(o.slots_);
    refs_.swap(o.refs_);
    std::swap(used_, o.used_);
  }

  /// An arena that shares this one's pages in use (no page is copied or allocated; each page's
  /// reference count goes up by one) and has no free slots. Pages in use are never written
  /// (a writer fills free slots only), and a shared page that leaves use is dropped, not
  /// recycled, so the two arenas never see each other's later writes. May throw bad_alloc
  /// (the page table), changing nothing.
  PageArena share() const {
    PageArena t(page_bytes_, alloc_);
    t.slots_.assign(slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(used_));
    t.refs_.assign(refs_.begin(), refs_.begin() + static_cast<std::ptrdiff_t>(used_));
    for (const Ref& r : t.refs_) r.acquire();
    t.used_ = used_;
    return t;
  }
  /// True when page i is also held by another arena (a fork), at the time of the call.
  bool shared(std::size_t i) const { return refs_[i].count() > 1; }
  /// Pages in use that another arena also holds, at the time of the call.
  std::size_t shared_pages() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < used_; ++i) n += shared(i) ? 1 : 0;
    return n;
  }

  /// The engine's allocator, or nullptr.
  PageAllocator* allocator() const { return alloc_; }
  /// Gives the free slots (pages past size()) back to the engine's allocator; with kvq's own
  /// chunks it does nothing (a chunk is freed whole, when no arena holds a page of it).
  void release_unused() noexcept {
    if (alloc_) drop_slots(used_);
  }

  std::size_t page_bytes() const { return page_bytes_; }
  /// Pages in use: [0, size()).
  std::size_t size() const { return used_; }
  /// Pages allocated (in use or free).
  std::size_t capacity() const { return slots_.size(); }
  /// Page i (i < capacity(): pages past size() are free slots a writer may fill before
  /// publishing them with resize(); a free slot is never shared).
  std::byte* page(std::size_t i) const { return slots_[i]; }
  /// The page table: capacity() pointers, the first size() in use.
  const std::byte* const* table() const {
    return reinterpret_cast<const std::byte* const*>(slots_.data());
  }
  /// Makes pages [0, n) the pages in use (n <= capacity(); no allocation, no throw). Pages
  /// that leave use become free slots, except shared ones, which this arena drops.
  void resize(std::size_t n) {
    const std::size_t before = used_;
    used_ = std::min(n, slots_.size());
    if (used_ < before) unshare_free(used_, before);
  }
  /// Takes the first n pages in use out of use (a sliding-window layer releasing its oldest
  /// pages): the pages in use keep their order and become [0, size() - n); the n pages become
  /// free slots (shared ones are dropped), reused by later writers or given back by
  /// release_unused(). No page moves in memory; no allocation, no throw.
  void drop_front(std::size_t n) noexcept {
    n = std::min(n, used_);
    const auto first = static_cast<std::ptrdiff_t>(n), last = static_cast<std::ptrdiff_t>(used_);
    std::rotate(slots_.begin(), slots_.begin() + first, slots_.begin() + last);
    std::rotate(refs_.begin(), refs_.begin() + first, refs_.begin() + last);
    used_ -= n;
    unshare_free(used_, used_ + n);
  }

  /// Ensures capacity() >= pages; allocates one chunk when it grows (may throw bad_alloc,
  /// changing nothing). Exact: reserve(n) on an empty arena allocates n pages.
  void reserve(std::size_t pages) {
    if (pages <= slots_.size()) return;
    add_chunk(pages - slots_.size());
  }
  /// Ensures room for `pages` pages, growing geometrically (half the pages this arena holds
  /// alone, at least the missing pages) so repeated growth costs O(log n) allocations; pages
  /// shared with a fork do not count, so a fork of a long prefix does not reserve half the
  /// prefix again.
  void grow_for(std::size_t pages) {
    if (pages <= slots_.size()) return;
    std::size_t own = 0;
    for (const Ref& r : refs_) own += r.count() == 1 ? 1 : 0;
    add_chunk(std::max(pages - slots_.size(), std::max<std::size_t>(1, own / 2)));
  }

  /// Bytes allocated for pages (capacity x page bytes, shared pages included) and for the page
  /// table.
  std::size_t allocated_bytes() const {
    return slots_.size() * page_bytes_ + slots_.capacity() * sizeof(std::byte*) +
           refs_.capacity() * sizeof(Ref);
  }

 private:
  /// The pages of one add_chunk() call, with a reference count per page (how many arenas hold
  /// it) and one for the group (the sum of its pages' counts). A page goes back to the
  /// engine's allocator when its count reaches zero; the group is freed when the group's does.
  /// One allocation: this header, the counts, and (kvq's own pages) the pages, 64-byte
  /// aligned. Atomic, so arenas sharing pages may be changed and destroyed on different
  /// threads.
  struct Group {
    std::atomic<std::size_t> holders;
    std::size_t page_bytes;
    PageAllocator* alloc;
    std::atomic<uint32_t>* refs() { return reinterpret_cast<std::atomic<uint32_t>*>(this + 1); }
    static std::size_t header_bytes(std::size_t n) {
      const std::size_t h = sizeof(Group) + n * sizeof(std::atomic<uint32_t>);
      return (h + kPageAlign - 1) / kPageAlign * kPageAlign;
    }
    /// A group of n pages, each held once; with `own_pages` the pages follow the header
    /// (zero-filled). Throws bad_alloc, allocating nothing.
    static Group* make(std::size_t n, std::size_t page_bytes, PageAllocator* alloc,
                       bool own_pages) {
      const std::size_t head = header_bytes(n);
      KVQ_REQUIRE(!own_pages || n <= (SIZE_MAX - head) / page_bytes, kOutOfRange, "PageArena: ",
                  n, " pages of ", page_bytes, " bytes do not fit in memory");
      const std::size_t bytes = head + (own_pages ? n * page_bytes : 0);
      void* mem = ::operator new(bytes, std::align_val_t(kPageAlign));
      Group* g = new (mem) Group;
      g->holders.store(n, std::memory_order_relaxed);
      g->page_bytes = page_bytes;
      g->alloc = alloc;
      for (std::size_t i = 0; i < n; ++i) new (g->refs() + i) std::atomic<uint32_t>(1);
      if (own_pages) std::memset(g->pages(n), 0, n * page_bytes);
      return g;
    }
    /// kvq's own pages, after the header of a group of n.
    std::byte* pages(std::size_t n) { return reinterpret_cast<std::byte*>(this) + header_bytes(n); }
    static void destroy(Group* g) noexcept {
      g->~Group();
      ::operator delete(static_cast<void*>(g), std::align_val_t(kPageAlign));
    }
  };
  /// One arena's hold on one page.
  struct Ref {
    Group* group = nullptr;
    std::size_t index = 0;
    uint32_t count() const { return group->refs()[index].load(std::memory_order_acquire); }
    void acquire() const {
      group->refs()[index].fetch_add(1, std::memory_order_relaxed);
      group->holders.fetch_add(1, std::memory_order_relaxed);
    }
    /// Drops the hold on `page`: the last holder gives it back to the engine's allocator, the
    /// last holder of any page of the group frees the group.
    void release(std::byte* page) const noexcept {
      Group* g = group;
      if (g->refs()[index].fetch_sub(1, std::memory_order_acq_rel) == 1 && g->alloc)
        g->alloc->release(page, g->page_bytes);
      if (g->holders.fetch_sub(1, std::memory_order_acq_rel) == 1) Group::destroy(g);
    }
  };

  /// Drops the slots past `keep` (they are free slots or, from the destructor, all).
  void drop_slots(std::size_t keep) noexcept {
    while (slots_.size() > keep) {
      refs_.back().release(slots_.back());
      slots_.pop_back();
      refs_.pop_back();
    }
    used_ = std::min(used_, keep);
  }
  /// Slots [from, to) just left use: the shared ones are dropped (another arena still reads
  /// them), the others stay as free slots. No allocation (erasing from a vector).
  void unshare_free(std::size_t from, std::size_t to) noexcept {
    std::size_t w = from;
    for (std::size_t i = from; i < slots_.size(); ++i) {
      if (i < to && refs_[i].count() > 1) {
        refs_[i].release(slots_[i]);
        continue;
      }
      slots_[w] = slots_[i];
      refs_[w] = refs_[i];
      ++w;
    }
    slots_.resize(w);
    refs_.resize(w);
  }

  void add_chunk(std::size_t pages) {
    KVQ_REQUIRE(page_bytes_ > 0 && page_bytes_ % kPageAlign == 0, kInvalidArgument,
                "PageArena: page size ", page_bytes_, " is not a positive multiple of ", kPageAlign);
    KVQ_REQUIRE(pages <= SIZE_MAX / page_bytes_, kOutOfRange, "PageArena: ", pages,
                " pages of ", page_bytes_, " bytes do not fit in memory");
    slots_.reserve(slots_.size() + pages);  // first: nothing below may fail after the chunk
    refs_.reserve(refs_.size() + pages);
    Group* g = Group::make(pages, page_bytes_, alloc_, alloc_ == nullptr);
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
        while (slots_.size() > before) {
          alloc_->release(slots_.back(), page_bytes_);
          slots_.pop_back();
        }
        Group::destroy(g);
        throw;
      }
    } else {
      for (std::size_t i = 0; i < pages; ++i) slots_.push_back(g->pages(pages) + i * page_bytes_);
    }
    for (std::size_t i = 0; i < pages; ++i) refs_.push_back(Ref{g, i});
  }

  std::size_t page_bytes_ = 0;
  PageAllocator* alloc_ = nullptr;
  std::vector<std::byte*> slots_;  // [capacity] page pointers, the first used_ in use
  std::vector<Ref> refs_;          // [capacity] this arena's hold on each page
  std::size_t used_ = 0;
};

}  // namespace kvq

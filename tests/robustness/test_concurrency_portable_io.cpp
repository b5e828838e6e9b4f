// Concurrent archive readers on kvq's portable file path (KVQ_ARCHIVE_POSIX=0: one std::ifstream
// per FileSource, positioned under a mutex; MappedArchive reads the file into memory), which
// non-POSIX platforms use. Built alone under ThreadSanitizer by `./kvq.sh test`, as
// test_concurrency is. A separate executable: the macro changes FileSource's definition.
#define KVQ_ARCHIVE_POSIX 0
#include <unistd.h>

#include "robustness/concurrent_archive_readers.hpp"

namespace {

TEST(ConcurrencyPortableIo, ArchiveReadersOnSeveralThreads) {
  static_assert(KVQ_ARCHIVE_POSIX == 0, "this test runs the portable file path");
  kvq_concurrent_io::check_concurrent_readers("portable", 4);
}

}  // namespace

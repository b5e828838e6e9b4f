// A tiny program for the self-tests of cmake/run_and_check.cmake: it exits with a chosen code
// after printing a chosen text, or dies from a signal, so the tests can show that the checker
// rejects a wrong exit code, a wrong text, a crash and a sanitizer report.
//
//   kvq_check_helper exit <code> <text>   print <text>, exit with <code>
//   kvq_check_helper abort <text>         print <text>, abort() (SIGABRT)
//   kvq_check_helper segv <text>          print <text>, raise(SIGSEGV)
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: kvq_check_helper exit <code> <text> | abort <text> | segv <text>\n");
    return 2;
  }
  const char* mode = argv[1];
  const bool is_exit = std::strcmp(mode, "exit") == 0;
  if (is_exit && argc < 4) {
    std::fprintf(stderr, "kvq_check_helper: exit needs <code> <text>\n");
    return 2;
  }
  std::printf("%s\n", argv[is_exit ? 3 : 2]);
  std::fflush(stdout);
  if (is_exit) return std::atoi(argv[2]);
  if (std::strcmp(mode, "abort") == 0) std::abort();
  if (std::strcmp(mode, "segv") == 0) std::raise(SIGSEGV);
  std::fprintf(stderr, "kvq_check_helper: unknown mode '%s'\n", mode);
  return 2;
}

# run_and_check.cmake: runs one command and checks its exit status AND its output.
#
# Why: ctest's PASS_REGULAR_EXPRESSION ignores the exit status, and WILL_FAIL also passes when
# the program crashes. A tool smoke test must require both: the documented exit code and the
# promised text; a signal (crash, abort) is always a failure, and so is any sanitizer report.
#
#   cmake [-DEXPECT_EXIT=<code>] [-DEXPECT_OUTPUT=<regex>] [-DREJECT_OUTPUT=<regex>]
#         [-DWORKING_DIRECTORY=<dir>] [-DTIMEOUT=<seconds>]
#         -P run_and_check.cmake -- <command> [args...]
#
#   EXPECT_EXIT     exit code the command must return (default 0)
#   EXPECT_OUTPUT   regex that stdout + stderr (interleaved as captured) must match; CMake
#                   regex syntax, '.' matches newlines too
#   REJECT_OUTPUT   regex that the output must NOT match (in addition to the sanitizer reports
#                   below)
#   SANITIZER_CHECK OFF lets sanitizer report text pass (only for the checker's own self-test,
#                   whose inner run prints such a report on purpose); default ON
#
# Everything after "--" is the command, one argument per argv entry (semicolons inside an
# argument are kept; empty arguments are not supported). Exits 0 when every check holds, else
# prints what went wrong and the command's output and exits non-zero. kvq's tools exit 0 on
# success, 1 when kvq reports an error (kvq::Error: bad spec, unreadable file) and 2 on a usage
# error (unknown flag, malformed number); see README "Tools".
cmake_minimum_required(VERSION 3.21)
cmake_policy(VERSION 3.21)

if(NOT DEFINED EXPECT_EXIT)
  set(EXPECT_EXIT 0)
endif()
if(NOT EXPECT_EXIT MATCHES "^[0-9]+$")
  message(FATAL_ERROR "run_and_check: EXPECT_EXIT must be a non-negative integer, got "
                      "'${EXPECT_EXIT}'")
endif()

set(_cmd)
set(_after_dashes OFF)
math(EXPR _last "${CMAKE_ARGC} - 1")
foreach(_i RANGE 0 ${_last})
  if(_after_dashes)
    string(REPLACE ";" "\\;" _arg "${CMAKE_ARGV${_i}}")
    list(APPEND _cmd "${_arg}")
  elseif("${CMAKE_ARGV${_i}}" STREQUAL "--")
    set(_after_dashes ON)
  endif()
endforeach()
if(NOT _cmd)
  message(FATAL_ERROR "run_and_check: no command given (put it after '--')")
endif()

set(_extra)
if(DEFINED WORKING_DIRECTORY)
  list(APPEND _extra WORKING_DIRECTORY "${WORKING_DIRECTORY}")
endif()
if(DEFINED TIMEOUT)
  list(APPEND _extra TIMEOUT "${TIMEOUT}")
endif()
execute_process(COMMAND ${_cmd} ${_extra} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out
                ERROR_VARIABLE _out)

# Show the command's output first (ctest --output-on-failure prints it with the verdict).
message("${_out}")

set(_problems)
if(NOT _rc MATCHES "^[0-9]+$")
  # execute_process reports a signal or a failure to start as text ("Segmentation fault",
  # "Subprocess aborted", "Process terminated due to timeout", "No such file or directory").
  list(APPEND _problems "the command did not exit normally: ${_rc} (crash, signal or timeout)")
elseif(NOT _rc EQUAL EXPECT_EXIT)
  list(APPEND _problems "exit code ${_rc}, expected ${EXPECT_EXIT}")
endif()
if(DEFINED EXPECT_OUTPUT AND NOT "${_out}" MATCHES "${EXPECT_OUTPUT}")
  list(APPEND _problems "output does not match the expected regex '${EXPECT_OUTPUT}'")
endif()
if(DEFINED REJECT_OUTPUT AND NOT "${REJECT_OUTPUT}" STREQUAL "" AND
   "${_out}" MATCHES "${REJECT_OUTPUT}")
  list(APPEND _problems "output matches the rejected regex '${REJECT_OUTPUT}'")
endif()
# Sanitizer reports are failures whatever the exit code (ASan's default exit code is 1, which
# is also kvq's error code).
if(NOT DEFINED SANITIZER_CHECK)
  set(SANITIZER_CHECK ON)
endif()
if(SANITIZER_CHECK AND
   "${_out}" MATCHES "(AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error: )")
  list(APPEND _problems "the output contains a sanitizer report")
endif()

list(JOIN _cmd " " _shown)
string(REPLACE "\\;" ";" _shown "${_shown}")
if(_problems)
  string(REPLACE ";" "\n  " _why "${_problems}")
  message(FATAL_ERROR "run_and_check: FAILED\n  ${_why}\ncommand: ${_shown}")
endif()
message(STATUS "run_and_check: ok (exit ${_rc}, output as expected)")

# same_results.cmake: runs two commands one after the other and requires the same results.
#
#   cmake [-DIGNORE=<regex>] [-DREQUIRE=<regex>] [-DFILE_A=<path> -DFILE_B=<path>]
#         -P same_results.cmake -- <command A> [args...] --then <command B> [args...]
#
# Both commands must exit 0. The text compared is each command's stdout, or, with FILE_A and
# FILE_B, those files (written by A and B). Every match of IGNORE is removed from both texts
# first (fields that name a source or a duration); what remains must be identical and match
# REQUIRE (so two empty or degenerate runs cannot pass). Used by the tools' calibration round
# trips: B loads what A saved (--save-calibration, then --calibrate) and must report the same
# numbers.
cmake_minimum_required(VERSION 3.21)
cmake_policy(VERSION 3.21)

set(_a)
set(_b)
set(_where none)
math(EXPR _last "${CMAKE_ARGC} - 1")
foreach(_i RANGE 0 ${_last})
  set(_arg "${CMAKE_ARGV${_i}}")
  if(_where STREQUAL "none")
    if(_arg STREQUAL "--")
      set(_where a)
    endif()
  elseif(_arg STREQUAL "--then")
    set(_where b)
  else()
    string(REPLACE ";" "\\;" _arg "${_arg}")
    if(_where STREQUAL "a")
      list(APPEND _a "${_arg}")
    else()
      list(APPEND _b "${_arg}")
    endif()
  endif()
endforeach()
if(NOT _a OR NOT _b)
  message(FATAL_ERROR "same_results: usage: -P same_results.cmake -- <A...> --then <B...>")
endif()

function(_run name cmd out_var)
  execute_process(COMMAND ${cmd} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(NOT _rc STREQUAL "0")
    message(FATAL_ERROR "same_results: FAILED: command ${name} exited with '${_rc}', expected 0\n"
                        "--- stdout ---\n${_out}\n--- stderr ---\n${_err}")
  endif()
  set(${out_var} "${_out}" PARENT_SCOPE)
endfunction()

_run(A "${_a}" _out_a)
_run(B "${_b}" _out_b)
if(DEFINED FILE_A OR DEFINED FILE_B)
  file(READ "${FILE_A}" _out_a)
  file(READ "${FILE_B}" _out_b)
endif()
if(DEFINED IGNORE AND NOT IGNORE STREQUAL "")
  string(REGEX REPLACE "${IGNORE}" "" _out_a "${_out_a}")
  string(REGEX REPLACE "${IGNORE}" "" _out_b "${_out_b}")
endif()
if(NOT _out_a STREQUAL _out_b)
  message(FATAL_ERROR "same_results: FAILED: the two runs differ\n--- A ---\n${_out_a}\n"
                      "--- B ---\n${_out_b}")
endif()
if(DEFINED REQUIRE AND NOT _out_a MATCHES "${REQUIRE}")
  message(FATAL_ERROR "same_results: FAILED: the results do not match '${REQUIRE}'\n${_out_a}")
endif()
message(STATUS "same_results: the two runs agree")

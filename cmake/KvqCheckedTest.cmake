# kvq_add_checked_test(NAME <name> [EXIT <code>] [OUTPUT <regex>] [REJECT <regex>]
#                      [WORKING_DIRECTORY <dir>] [ALLOW_SANITIZER_TEXT]
#                      COMMAND <exe-or-target> [args...])
#
# Adds a CTest test that runs the command through cmake/run_and_check.cmake, so the test passes
# only when the command exits with EXIT (default 0), its output (stdout + stderr) matches
# OUTPUT, does not match REJECT, contains no sanitizer report, and no signal ended it.
# Use it for every tool smoke test instead of PASS_REGULAR_EXPRESSION / WILL_FAIL, which
# ignore the exit status or accept a crash. The first COMMAND word may be a target name.
# ALLOW_SANITIZER_TEXT is for the checker's self-test only (see tests/CMakeLists.txt).
# Arguments containing ';' (policy lists such as "f32;kivi2") are passed through unchanged.
set(KVQ_RUN_AND_CHECK ${CMAKE_CURRENT_LIST_DIR}/run_and_check.cmake CACHE INTERNAL
    "kvq's exit-code-and-output test checker")

function(kvq_add_checked_test)
  # Parsed by hand (not cmake_parse_arguments): every argument after COMMAND is kept as one
  # element (semicolons kept), so "f32;kivi2" reaches the tool as one argument.
  set(_name)
  set(_exit 0)
  set(_defs)
  set(_cmd)
  set(_key)
  math(EXPR _last "${ARGC} - 1")
  foreach(_i RANGE 0 ${_last})
    # $<SEMICOLON>: add_test splits its arguments on ';' before evaluating generator expressions.
    string(REPLACE ";" "$<SEMICOLON>" _v "${ARGV${_i}}")
    if(_key STREQUAL "COMMAND")
      list(APPEND _cmd "${_v}")
    elseif(_key)
      if(_key STREQUAL "NAME")
        set(_name "${_v}")
      elseif(_key STREQUAL "EXIT")
        set(_exit "${_v}")
      elseif(_key STREQUAL "OUTPUT")
        list(APPEND _defs "-DEXPECT_OUTPUT=${_v}")
      elseif(_key STREQUAL "REJECT")
        list(APPEND _defs "-DREJECT_OUTPUT=${_v}")
      elseif(_key STREQUAL "WORKING_DIRECTORY")
        list(APPEND _defs "-DWORKING_DIRECTORY=${_v}")
      endif()
      set(_key)
    elseif(_v STREQUAL "ALLOW_SANITIZER_TEXT")
      list(APPEND _defs "-DSANITIZER_CHECK=OFF")
    elseif(_v MATCHES "^(NAME|EXIT|OUTPUT|REJECT|WORKING_DIRECTORY|COMMAND)$")
      set(_key "${_v}")
    else()
      message(FATAL_ERROR "kvq_add_checked_test: unexpected argument '${_v}'")
    endif()
  endforeach()
  if(NOT _name OR NOT _cmd)
    message(FATAL_ERROR "kvq_add_checked_test: NAME and COMMAND are required")
  endif()
  list(GET _cmd 0 _exe)
  list(REMOVE_AT _cmd 0)
  if(TARGET ${_exe})
    set(_exe $<TARGET_FILE:${_exe}>)
  endif()
  add_test(NAME ${_name}
           COMMAND ${CMAKE_COMMAND} -DEXPECT_EXIT=${_exit} ${_defs} -P ${KVQ_RUN_AND_CHECK} --
                   ${_exe} ${_cmd})
endfunction()

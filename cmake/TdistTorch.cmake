# Finds the libtorch that the pip `torch` wheel carries and defines `tdist_torch::torch`
# (torch_cpu + c10, the C++ frontend headers included) and, where the wheel has them,
# `tdist_torch::python` (libtorch_python) and `tdist_torch::cuda` (torch_cuda + c10_cuda).
#
# The prefix comes from `python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'`
# (or TDIST_TORCH_PREFIX / Torch_DIR when given). We read TorchConfig's location from it but do
# not call find_package(Torch): on the CUDA wheel that pulls in the CUDA toolkit and torch_cuda
# for every consumer, which fails on machines without the toolkit. tdist's CPU code needs only
# torch_cpu and c10, so the build is the same with or without CUDA.
if(TARGET tdist_torch::torch)
  return()
endif()

if(SKBUILD AND Python3_EXECUTABLE)
  # `pip install .` (pyproject.toml): build against the torch of the Python that runs pip.
  set(TDIST_PYTHON "${Python3_EXECUTABLE}")
elseif(NOT TDIST_PYTHON)
  find_program(TDIST_PYTHON NAMES python3 python REQUIRED)
endif()

if(NOT TDIST_TORCH_PREFIX)
  if(Torch_DIR)
    get_filename_component(_tdist_torch_cmake "${Torch_DIR}/../.." ABSOLUTE)
  else()
    execute_process(
      COMMAND "${TDIST_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _tdist_torch_cmake OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _tdist_rc ERROR_QUIET)
    if(SKBUILD AND (NOT _tdist_rc EQUAL 0 OR NOT EXISTS "${_tdist_torch_cmake}/Torch/TorchConfig.cmake"))
      # pip builds in an isolated environment unless told not to, and torch is not in it: the
      # module must be built against the torch it will be loaded with.
      message(FATAL_ERROR "tdist: ${TDIST_PYTHON} cannot import torch. tdist_c10d is built "
                          "against the torch already installed: install torch first, then run "
                          "`pip install --no-build-isolation .` (pip's isolated build "
                          "environment has no torch).")
    endif()
    if(NOT _tdist_rc EQUAL 0 OR NOT EXISTS "${_tdist_torch_cmake}/Torch/TorchConfig.cmake")
      message(FATAL_ERROR "tdist: cannot find libtorch. Install the pinned PyTorch with "
                          "scripts/setup.sh (or `python3 -m pip install torch`), or pass "
                          "-DTDIST_TORCH_PREFIX=<site-packages>/torch.")
    endif()
  endif()
  # <prefix>/share/cmake -> <prefix>
  get_filename_component(TDIST_TORCH_PREFIX "${_tdist_torch_cmake}/../.." ABSOLUTE)
  set(TDIST_TORCH_PREFIX "${TDIST_TORCH_PREFIX}" CACHE PATH "libtorch prefix (the torch package)")
endif()

find_library(TDIST_TORCH_CPU_LIB torch_cpu PATHS "${TDIST_TORCH_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)
find_library(TDIST_C10_LIB c10 PATHS "${TDIST_TORCH_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)

add_library(tdist_torch::torch INTERFACE IMPORTED)
set_target_properties(tdist_torch::torch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES
    "${TDIST_TORCH_PREFIX}/include;${TDIST_TORCH_PREFIX}/include/torch/csrc/api/include"
  INTERFACE_LINK_LIBRARIES "${TDIST_TORCH_CPU_LIB};${TDIST_C10_LIB}"
  # The pip wheels are built with the C++11 ABI.
  INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=1")
# Mark torch's headers as system headers so that -Wall -Wextra reports only our code.
set_property(TARGET tdist_torch::torch PROPERTY INTERFACE_SYSTEM_INCLUDE_DIRECTORIES
  "${TDIST_TORCH_PREFIX}/include;${TDIST_TORCH_PREFIX}/include/torch/csrc/api/include")

find_library(TDIST_TORCH_PYTHON_LIB torch_python PATHS "${TDIST_TORCH_PREFIX}/lib" NO_DEFAULT_PATH)
if(TDIST_TORCH_PYTHON_LIB)
  add_library(tdist_torch::python INTERFACE IMPORTED)
  set_target_properties(tdist_torch::python PROPERTIES
    INTERFACE_LINK_LIBRARIES "${TDIST_TORCH_PYTHON_LIB};tdist_torch::torch")
endif()

find_library(TDIST_TORCH_CUDA_LIB torch_cuda PATHS "${TDIST_TORCH_PREFIX}/lib" NO_DEFAULT_PATH)
find_library(TDIST_C10_CUDA_LIB c10_cuda PATHS "${TDIST_TORCH_PREFIX}/lib" NO_DEFAULT_PATH)
if(TDIST_TORCH_CUDA_LIB AND TDIST_C10_CUDA_LIB)
  add_library(tdist_torch::cuda INTERFACE IMPORTED)
  set_target_properties(tdist_torch::cuda PROPERTIES
    INTERFACE_LINK_LIBRARIES "${TDIST_TORCH_CUDA_LIB};${TDIST_C10_CUDA_LIB};tdist_torch::torch")
endif()

message(STATUS "tdist: libtorch at ${TDIST_TORCH_PREFIX}")

# The Debian package: `cpack -G DEB` in a build directory makes tdist_<version>_<arch>.deb from
# what that build already holds (cpack installs, it does not compile): the libraries, the headers
# under include/tdist, the CMake package (lib/cmake/tdist), tdist-run, tdist-train, tdist-bench
# and the RPC demos, under /usr. The PyTorch backend (tdist_c10d, the `python` install
# component) stays out: it belongs to the pip torch's Python, not to a Debian path.
#
# Dependencies: the Debian packages of the libraries tdist links and of the headers its CMake
# package asks for (find_dependency in tdistConfig.cmake). libtorch is not one of them: it comes
# from the pip wheel (README, "Install as a package"), and the binaries look for it where the
# build found it (TDIST_TORCH_PREFIX, in their RPATH) or on LD_LIBRARY_PATH. Nor are the CUDA and
# NCCL libraries of libtdist_comm_nccl (where the build made it): the CUDA wheel's, loaded only
# when a process group serves CUDA tensors through NCCL.
set(CPACK_PACKAGE_NAME tdist)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Distributed training for C++ on libtorch: collectives, DDP, FSDP, RPC, tdist-run")
set(CPACK_PACKAGE_CONTACT "tdist maintainers <tdist@localhost>")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# Only the default component: everything but the Python module.
set(CPACK_INSTALL_CMAKE_PROJECTS "${PROJECT_BINARY_DIR};tdist;Unspecified;/")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # tdist_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(_tdist_deb_depends
    "libc6 (>= 2.36), libstdc++6 (>= 12), libgcc-s1, libssl3, libspdlog1.10, libfmt9, libssl-dev, libboost-dev (>= 1.74), libcereal-dev")
if(TARGET tdist-bench-mpi)
  # Open MPI's library, for tdist-bench's MPI anchor (built where MPI was found).
  string(APPEND _tdist_deb_depends ", libopenmpi3")
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${_tdist_deb_depends}")
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION
    "tdist gives C++ programs on libtorch what torch.distributed gives Python: collectives,\n DistributedDataParallel, FSDP, RPC with remote references, distributed autograd, and the\n launcher tdist-run (torchrun's command lines). libtorch itself comes from PyPI's torch wheel\n (python3 -m pip install torch), which is not a Debian package.")
include(CPack)

// The target that precompiles <torch/torch.h> for every executable (cmake/TdistHelpers.cmake,
// tdist_use_torch_pch); it is never run.
int main() { return 0; }

#include "tdist/comm/device_mesh.h"

#include <set>
#include <sstream>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"

namespace tdist::comm {
namespace {

std::string describe(const std::vector<DeviceMesh::Dim>& dims) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < dims.size(); ++i) {
    os << (i ? ", " : "") << "\"" << dims[i].name << "\": " << dims[i].size;
  }
  os << "}";
  return os.str();
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<ProcessGroup> world, std::vector<Dim> dims)
    : world_(std::move(world)), dims_(std::move(dims)) {
  TDIST_CHECK_ARG(world_ != nullptr, "DeviceMesh: the world process group is null");
  TDIST_CHECK_ARG(!dims_.empty(), "DeviceMesh: no dimensions");
  std::set<std::string> names;
  int64_t product = 1;
  for (const Dim& d : dims_) {
    TDIST_CHECK_ARG(!d.name.empty(), "DeviceMesh: a dimension has an empty name in ",
                    describe(dims_));
    TDIST_CHECK_ARG(names.insert(d.name).second, "DeviceMesh: dimension \"", d.name,
                    "\" is named twice in ", describe(dims_));
    TDIST_CHECK_ARG(d.size >= 1, "DeviceMesh: dimension \"", d.name, "\" has size ", d.size,
                    "; sizes must be at least 1");
    product *= d.size;
  }
  TDIST_CHECK_ARG(product == world_->size(), "DeviceMesh: the sizes of ", describe(dims_),
                  " multiply to ", product, ", not to the world size ", world_->size());

  coords_ = coordinates_of(world_->rank());
  groups_.resize(dims_.size());
  // Note [Device mesh layout]: every group of every dimension, in one order on every rank.
  for (size_t d = 0; d < dims_.size(); ++d) {
    for (int start = 0; start < world_->size(); ++start) {
      std::vector<int> c = coordinates_of(start);
      if (c[d] != 0) continue;  // each group once: at its member with coordinate 0 in d
      std::vector<int> ranks;
      for (int k = 0; k < dims_[d].size; ++k) {
        c[d] = k;
        ranks.push_back(rank_of(c));
      }
      auto group = world_->new_group(ranks);
      if (group != nullptr) groups_[d] = std::move(group);
    }
    TDIST_CHECK(groups_[d] != nullptr, "DeviceMesh: rank ", world_->rank(),
                " got no group along \"", dims_[d].name, "\"");
    TDIST_CHECK_EQ(groups_[d]->rank(), coords_[d], "DeviceMesh: rank in the group along \"",
                   dims_[d].name, "\"");
  }
}

DeviceMesh::~DeviceMesh() = default;
DeviceMesh::DeviceMesh(DeviceMesh&&) noexcept = default;
DeviceMesh& DeviceMesh::operator=(DeviceMesh&&) noexcept = default;

int DeviceMesh::dim_index(const std::string& name) const {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].name == name) return static_cast<int>(i);
  }
  TDIST_THROW(InvalidArgument, "DeviceMesh: no dimension \"", name, "\"; the mesh is ",
              describe(dims_));
}

bool DeviceMesh::has_dim(const std::string& name) const {
  for (const Dim& d : dims_) {
    if (d.name == name) return true;
  }
  return false;
}

int DeviceMesh::size() const { return world_->size(); }
int DeviceMesh::rank() const { return world_->rank(); }

const std::shared_ptr<ProcessGroup>& DeviceMesh::group(int dim) const {
  TDIST_CHECK_ARG(dim >= 0 && dim < ndim(), "DeviceMesh: dimension ", dim, " is not in [0, ",
                  ndim(), ")");
  return groups_[dim];
}

std::vector<int> DeviceMesh::group_ranks(const std::string& name) const {
  const int d = dim_index(name);
  std::vector<int> c = coords_;
  std::vector<int> out;
  for (int k = 0; k < dims_[d].size; ++k) {
    c[d] = k;
    out.push_back(rank_of(c));
  }
  return out;
}

int DeviceMesh::rank_of(const std::vector<int>& coords) const {
  TDIST_CHECK_ARG(coords.size() == dims_.size(), "DeviceMesh: ", coords.size(),
                  " coordinates for a mesh of ", dims_.size(), " dimensions");
  int rank = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    TDIST_CHECK_ARG(coords[i] >= 0 && coords[i] < dims_[i].size, "DeviceMesh: coordinate ",
                    coords[i], " of \"", dims_[i].name, "\" is not in [0, ", dims_[i].size, ")");
    rank = rank * dims_[i].size + coords[i];
  }
  return rank;
}

std::vector<int> DeviceMesh::coordinates_of(int rank) const {
  TDIST_CHECK_ARG(rank >= 0 && rank < world_->size(), "DeviceMesh: rank ", rank, " is not in [0, ",
                  world_->size(), ")");
  std::vector<int> c(dims_.size());
  for (size_t i = dims_.size(); i-- > 0;) {
    c[i] = rank % dims_[i].size;
    rank /= dims_[i].size;
  }
  return c;
}

}  // namespace tdist::comm

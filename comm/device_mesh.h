#pragma once
// DeviceMesh: a world of ranks laid out as an n-dimensional array with named dimensions, and this
// rank's subgroup along each dimension (PyTorch's DeviceMesh / init_device_mesh).
//
//   auto world = tdist::comm::create_process_group("env://");            // 4 ranks
//   tdist::comm::DeviceMesh mesh(world, {{"replicate", 2}, {"shard", 2}});
//   mesh.group("shard");       // the 2 ranks that share this rank's "replicate" coordinate
//   mesh.coordinate("replicate");
//
// Note [Device mesh layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Rank r of the world sits at the coordinates of r in row-major order over the dimension sizes
// (the last dimension varies fastest), as PyTorch's arange(world).view(sizes): with
// {"replicate", 2}, {"shard", 2} ranks 0 and 1 form a shard group and ranks 0 and 2 a replicate
// group; with {"pp", 2}, {"dp", 2}, stage 0 holds ranks 0 and 1. The group of rank r along
// dimension d is every rank whose coordinates equal r's but in d, ordered by that coordinate, so
// a rank's rank in its group along d is its coordinate in d.
//
// Construction creates every group of every dimension with ProcessGroup::new_group, dimension
// by dimension, and within a dimension in row-major order of the other coordinates: the same
// calls in the same order on every rank, as new_group requires (each rank keeps the groups it is
// a member of). So it is a collective over the world: every rank constructs the same mesh, and
// the construction blocks until each of this rank's groups is connected (bounded by the world's
// timeout). The input is checked before any group is created: sizes that do not multiply to the
// world size, a size below 1, an empty or repeated name throw InvalidArgument on every rank.
//
// Thread safety: constant after construction; the groups are ProcessGroups (see
// process_group.h). Ownership: the mesh shares the world group and owns its subgroups.

#include <memory>
#include <string>
#include <vector>

namespace tdist::comm {

class ProcessGroup;

class DeviceMesh {
 public:
  struct Dim {
    std::string name;
    int size = 1;
  };

  // A collective over `world` (see the Note). Throws InvalidArgument on bad dimensions.
  DeviceMesh(std::shared_ptr<ProcessGroup> world, std::vector<Dim> dims);
  ~DeviceMesh();
  DeviceMesh(DeviceMesh&&) noexcept;
  DeviceMesh& operator=(DeviceMesh&&) noexcept;
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  const std::vector<Dim>& dims() const { return dims_; }
  int ndim() const { return static_cast<int>(dims_.size()); }
  // The index of the dimension called `name`; InvalidArgument naming the known ones if none is.
  int dim_index(const std::string& name) const;
  bool has_dim(const std::string& name) const;
  int size(const std::string& name) const { return dims_[dim_index(name)].size; }
  // The world's size.
  int size() const;
  // This rank's world rank and its coordinate along each dimension (row-major, see the Note).
  int rank() const;
  const std::vector<int>& coordinates() const { return coords_; }
  int coordinate(const std::string& name) const { return coords_[dim_index(name)]; }

  // This rank's subgroup along a dimension (its rank in it is coordinate(name)).
  const std::shared_ptr<ProcessGroup>& group(const std::string& name) const {
    return groups_[dim_index(name)];
  }
  const std::shared_ptr<ProcessGroup>& group(int dim) const;
  // The world ranks of this rank's group along a dimension, in the group's rank order.
  std::vector<int> group_ranks(const std::string& name) const;
  const std::shared_ptr<ProcessGroup>& world() const { return world_; }

  // The world rank at `coords` (one per dimension, each in range), and the reverse.
  int rank_of(const std::vector<int>& coords) const;
  std::vector<int> coordinates_of(int rank) const;

 private:
  // Constant after construction:
  std::shared_ptr<ProcessGroup> world_;
  std::vector<Dim> dims_;
  std::vector<int> coords_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;  // one per dimension
};

}  // namespace tdist::comm

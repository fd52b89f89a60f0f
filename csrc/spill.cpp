// The disk tier: the per-process spill directory (made, probed for O_DIRECT, removed at exit, never
// another process's), one file per spilled tensor, and the worker threads that write and read them.
#include "spill.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <thread>
#include <random>

namespace ckpt_offload {

namespace {

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// The per-process directory, held by descriptors from the moment it is made: the user's directory
// (to remove it by name at the end) and its own (every file is opened and unlinked through it, by a
// name the tier made, with O_NOFOLLOW). Nothing is ever looked up by path again, so a folder swapped
// for a symlink, or a chdir(), changes nothing. Only the process that made it removes anything.
struct DirHandle {
  int parent_fd = -1;  // the user's directory
  int fd = -1;         // the per-process directory
  std::string name;    // its name in the user's directory
  std::string path;    // absolute, for messages and spill_dir
  dev_t dev = 0;
  ino_t ino = 0;
  pid_t owner = 0;
  bool removed = false;  // under the exit list's lock
  ~DirHandle() {
    if (fd >= 0) close(fd);
    if (parent_fd >= 0) close(parent_fd);
  }
};

// Per-process directories still on disk: removed at exit by the process that made each (a child
// forked after set_spill_dir inherits the list but not the directories).
struct ExitList {
  std::mutex mu;
  std::map<DirHandle*, std::shared_ptr<DirHandle>> dirs;
};

// Live tiers, for fork(): brought to rest before it and released after it in both processes.
struct ForkList {
  std::mutex mu;  // held across fork(): before any tier's lock
  std::vector<std::weak_ptr<SpillTier>> tiers;
  std::vector<std::shared_ptr<SpillTier>> held;  // the tiers at rest during a fork()
};

ForkList& fork_list() {
  static auto* list = new ForkList();  // leaked: the fork handlers outlive static destruction
  return *list;
}

ExitList& exit_list() {
  static auto* list = new ExitList();  // leaked: used by the atexit handler
  return *list;
}

// A file name the tier makes: "probe" or "<n>.bin".
bool own_name(const char* name) {
  if (std::strcmp(name, "probe") == 0) return true;
  const char* p = name;
  while (*p >= '0' && *p <= '9') ++p;
  return p != name && std::strcmp(p, ".bin") == 0;
}

// Only what this process put there, caller holds the exit list's lock: its own file names inside its
// own directory (through the descriptor), then the directory itself, and that only while the name in
// the user's directory is still that directory (not a symlink or another folder swapped in).
void remove_tree_locked(DirHandle& h) {
  if (h.removed || h.owner != getpid()) return;
  h.removed = true;
  const int scan = dup(h.fd);
  if (scan >= 0) {
    if (DIR* d = fdopendir(scan)) {
      std::vector<std::string> names;
      while (dirent* e = readdir(d)) {
        if (own_name(e->d_name)) names.emplace_back(e->d_name);
      }
      closedir(d);  // closes scan
      for (const auto& n : names) unlinkat(h.fd, n.c_str(), 0);
    } else {
      close(scan);
    }
  }
  struct stat now {};
  if (fstatat(h.parent_fd, h.name.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(now.st_mode) &&
      now.st_dev == h.dev && now.st_ino == h.ino) {
    unlinkat(h.parent_fd, h.name.c_str(), AT_REMOVEDIR);  // ENOTEMPTY when something else is in it: left
  }
}

void remove_at_exit() {
  ExitList& list = exit_list();
  std::lock_guard<std::mutex> lock(list.mu);
  for (auto& kv : list.dirs) remove_tree_locked(*kv.second);
}

void register_for_exit(const std::shared_ptr<DirHandle>& h) {
  static const bool registered = [] { return std::atexit(remove_at_exit) == 0; }();
  (void)registered;
  ExitList& list = exit_list();
  std::lock_guard<std::mutex> lock(list.mu);
  list.dirs[h.get()] = h;
}

void remove_and_unregister(const std::shared_ptr<DirHandle>& h) {
  ExitList& list = exit_list();
  std::lock_guard<std::mutex> lock(list.mu);
  remove_tree_locked(*h);
  list.dirs.erase(h.get());
}

// The user's directory as given, made absolute against today's working directory (resolved once: a
// later chdir() does not move it). Symlinks in it are the user's own and are kept as written.
std::string absolute_path(const std::string& dir) {
  if (!dir.empty() && dir[0] == '/') return dir;
  std::vector<char> cwd(4096);
  while (getcwd(cwd.data(), cwd.size()) == nullptr) {
    if (errno != ERANGE) return dir;
    cwd.resize(cwd.size() * 2);
  }
  std::string base(cwd.data());
  std::string rel = dir;
  while (rel.rfind("./", 0) == 0) rel.erase(0, 2);
  if (rel == "." || rel.empty()) return base;
  return base + (base.back() == '/' ? "" : "/") + rel;
}

// Who may rename entries in the user's directory, from its fstat: the tier refuses a directory that
// belongs to another user (root's are fine: root can do anything anyway), or that others may write
// to without the sticky bit (they could swap the per-process folder for a link). "" when fine.
std::string unsafe_reason(const struct stat& sb) {
  const uid_t me = geteuid();
  if (sb.st_uid != me && sb.st_uid != 0) {
    return " belongs to another user (uid " + std::to_string(sb.st_uid) + "): they could replace the tier's folder in it";
  }
  if ((sb.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (sb.st_mode & S_ISVTX) == 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(sb.st_mode & 07777));
    return std::string(" can be written by others (mode ") + mode +
           ") and has no sticky bit: they could replace the tier's folder in it with a link; use a folder of "
           "your own, or `chmod +t` it";
  }
  return std::string();
}

// <dir>/ckpt_offload-<pid>-XXXXXX made through the user's directory's descriptor, mode 0700, and
// opened with O_NOFOLLOW; null with `msg` set on failure.
std::shared_ptr<DirHandle> make_process_dir(int parent_fd, const std::string& parent_path, std::string& msg) {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::random_device rd;
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string name = "ckpt_offload-" + std::to_string(getpid()) + "-";
    for (int i = 0; i < 6; ++i) name += kChars[rd() % (sizeof(kChars) - 1)];
    if (mkdirat(parent_fd, name.c_str(), 0700) != 0) {
      if (errno == EEXIST) continue;
      msg = "cannot make a directory in it: " + errno_text(errno);
      return nullptr;
    }
    const int fd = openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat sb {};
    if (fd < 0 || fstat(fd, &sb) != 0 || sb.st_uid != geteuid() || (sb.st_mode & 077) != 0) {
      const int err = errno;
      if (fd >= 0) close(fd);
      msg = "the directory it made (" + name + ") was replaced before it could be opened" +
            (fd < 0 ? ": " + errno_text(err) : std::string());
      return nullptr;
    }
    auto h = std::make_shared<DirHandle>();
    h->parent_fd = dup(parent_fd);
    h->fd = fd;
    h->name = name;
    h->path = parent_path + (parent_path.back() == '/' ? "" : "/") + name;
    h->dev = sb.st_dev;
    h->ino = sb.st_ino;
    h->owner = getpid();
    if (h->parent_fd < 0) {
      msg = "cannot duplicate a descriptor: " + errno_text(errno);
      unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR);
      return nullptr;
    }
    register_for_exit(h);
    return h;
  }
  msg = "cannot make a directory in it: 100 names taken";
  return nullptr;
}

// Whether O_DIRECT works in the directory: tmpfs and some network filesystems refuse it at open
// (EINVAL); others accept the open and refuse the I/O. One aligned block written and read back decides.
bool probe_direct(int dir_fd) {
  int fd = openat(dir_fd, "probe", O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | O_DIRECT, 0600);
  if (fd < 0) return false;
  void* buf = nullptr;
  bool ok = posix_memalign(&buf, SpillTier::kAlign, SpillTier::kAlign) == 0;
  if (ok) {
    std::memset(buf, 0x5a, SpillTier::kAlign);
    ok = pwrite(fd, buf, SpillTier::kAlign, 0) == static_cast<ssize_t>(SpillTier::kAlign);
    std::memset(buf, 0, SpillTier::kAlign);
    ok = ok && pread(fd, buf, SpillTier::kAlign, 0) == static_cast<ssize_t>(SpillTier::kAlign) &&
         static_cast<unsigned char*>(buf)[SpillTier::kAlign - 1] == 0x5a;
    std::free(buf);
  }
  close(fd);
  unlinkat(dir_fd, "probe", 0);
  return ok;
}

}  // namespace

// The per-process directory; every file holds it, so it goes when the tier and the files have (in
// the process that made it: a forked child's copy only closes its descriptors).
class SpillDir {
 public:
  explicit SpillDir(std::shared_ptr<DirHandle> h) : handle(std::move(h)), path(handle->path) {}
  ~SpillDir() { remove_and_unregister(handle); }  // empty by now unless a file could not be removed
  int fd() const { return handle->fd; }
  bool owned() const { return handle->owner == getpid(); }
  const std::shared_ptr<DirHandle> handle;
  const std::string path;
};

// ---------------------------------------------------------------------------------------------
// SpillFile, SpillJob

SpillFile::SpillFile(std::shared_ptr<SpillDir> dir, std::shared_ptr<DiskUsage> usage, std::string name,
                     size_t nbytes, bool direct)
    : dir_(std::move(dir)),
      usage_(std::move(usage)),
      name_(std::move(name)),
      path_(dir_->path + "/" + name_),
      nbytes_(nbytes),
      direct_(direct) {}

SpillFile::~SpillFile() {
  // ENOENT when never written or already gone: nothing to do. A forked child's copy never unlinks:
  // the file is its parent's.
  if (dir_->owned()) unlinkat(dir_->fd(), name_.c_str(), 0);
  usage_->bytes.fetch_sub(io_bytes());
  usage_->files.fetch_sub(1);
}

int SpillFile::dir_fd() const { return dir_->fd(); }

size_t SpillFile::io_bytes() const { return direct_ ? round_up(nbytes_, SpillTier::kAlign) : nbytes_; }

void SpillJob::wait() {
  if (done()) return;
  // Queued before a fork(): the worker that would run it lives only in the parent.
  if (getpid() != owner_) {
    throw std::runtime_error("ckpt_offload: a disk-tier " + std::string(write_ ? "write" : "read") +
                             " queued before fork() cannot complete in the child (its worker threads stay with "
                             "the parent); switch the disk tier off in the child (set_spill_dir(None))");
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done(); });
}

std::shared_ptr<HostBlock> SpillJob::take_block() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(block_);
}

std::shared_ptr<HostBlock> SpillJob::peek_block() {
  std::lock_guard<std::mutex> lock(mu_);
  return block_;
}

// ---------------------------------------------------------------------------------------------
// SpillTier

std::shared_ptr<SpillTier> SpillTier::create(const std::string& dir, uint64_t max_bytes, int read_ahead,
                                             int spill_ahead, int threads) {
  const std::string where = "set_spill_dir: path '" + dir + "'";
  if (dir.empty()) throw SpillPathError("set_spill_dir: path must not be empty");
  if (read_ahead < 0 || spill_ahead < 0 || threads < 1) {
    throw std::invalid_argument("set_spill_dir: read_ahead and spill_ahead must be >= 0");
  }
  const std::string abs = absolute_path(dir);
  // The user's directory is opened once; everything after goes through this descriptor.
  const int user_fd = open(abs.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (user_fd < 0) {
    const int err = errno;
    struct stat sb {};
    if (err == ENOTDIR || (stat(abs.c_str(), &sb) == 0 && !S_ISDIR(sb.st_mode))) {
      throw SpillPathError(where + " is not a directory");
    }
    throw SpillPathError(where + (err == ENOENT ? " does not exist" : " cannot be opened: " + errno_text(err)));
  }
  std::shared_ptr<SpillTier> tier(new SpillTier(abs, user_fd, max_bytes, read_ahead, spill_ahead));
  struct stat sb {};
  if (fstat(user_fd, &sb) != 0) throw SpillPathError(where + " cannot be examined: " + errno_text(errno));
  const std::string unsafe = unsafe_reason(sb);
  if (!unsafe.empty()) throw SpillPathError(where + unsafe);
  if (faccessat(user_fd, ".", W_OK | X_OK, 0) != 0) {
    throw SpillPathError(where + " is not writable: " + errno_text(errno));
  }
  std::string msg;
  auto handle = make_process_dir(user_fd, abs, msg);
  if (!handle) throw SpillPathError(where + " is not writable: " + msg);
  tier->dir_ = std::make_shared<SpillDir>(handle);
  // A real write as well (root passes access(), a read-only filesystem does not pass this).
  const int dfd = handle->fd;
  int fd = openat(dfd, "probe", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 || ::write(fd, "x", 1) != 1) {
    const int err = errno;
    if (fd >= 0) close(fd);
    unlinkat(dfd, "probe", 0);
    throw SpillPathError(where + " is not writable: " + errno_text(err));
  }
  close(fd);
  unlinkat(dfd, "probe", 0);
  tier->direct_ = probe_direct(dfd);
  tier->st_.direct = tier->direct_;
  static const bool fork_handlers = [] {
    return pthread_atfork(&SpillTier::fork_prepare, &SpillTier::fork_parent, &SpillTier::fork_child) == 0;
  }();
  (void)fork_handlers;
  {
    ForkList& list = fork_list();
    std::lock_guard<std::mutex> lock(list.mu);
    list.tiers.erase(std::remove_if(list.tiers.begin(), list.tiers.end(),
                                    [](const std::weak_ptr<SpillTier>& w) { return w.expired(); }),
                     list.tiers.end());
    list.tiers.push_back(tier);
  }
  for (int i = 0; i < threads; ++i) std::thread([self = tier] { self->run(); }).detach();
  return tier;
}

SpillTier::SpillTier(std::string dir, int user_fd, uint64_t max_bytes, int read_ahead, int spill_ahead)
    : user_dir_(std::move(dir)),
      user_fd_(user_fd),
      owner_(getpid()),
      max_bytes_(max_bytes),
      read_ahead_(read_ahead),
      spill_ahead_(spill_ahead) {
  st_.max_bytes = max_bytes;
}

SpillTier::~SpillTier() {
  if (user_fd_ >= 0) close(user_fd_);
}

void SpillTier::stop() {
  std::shared_ptr<SpillDir> dir;  // removed here unless files still hold it
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;  // the workers drain their queues first, then let go of the tier
    dir = std::move(dir_);
  }
  cv_.notify_all();
}

const std::string& SpillTier::dir() const { return user_dir_; }

std::string SpillTier::process_dir() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dir_ ? dir_->path : std::string();
}

std::shared_ptr<SpillDir> SpillTier::current_dir() {
  if (!dir_) {
    std::string msg;
    auto handle = make_process_dir(user_fd_, user_dir_, msg);
    if (!handle) {
      dir_error_ = "'" + user_dir_ + "': " + msg;
      return nullptr;
    }
    dir_ = std::make_shared<SpillDir>(handle);
  }
  return dir_;
}

void SpillTier::remove_dir_if_empty() {
  std::shared_ptr<SpillDir> old;
  std::lock_guard<std::mutex> lock(mu_);
  if (usage_->files.load() == 0) old = std::move(dir_);  // removed here unless a file still holds it
}

std::shared_ptr<SpillFile> SpillTier::new_file(size_t nbytes, const HostBlock& block) {
  if (failed_.load()) return nullptr;
  // A forked child does not spill: the folder, its file numbers and the workers are its parent's.
  if (getpid() != owner_) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) return nullptr;
  std::shared_ptr<SpillDir> dir = current_dir();
  if (!dir) return nullptr;
  const bool aligned = reinterpret_cast<uintptr_t>(block.data()) % kAlign == 0;
  const bool direct = direct_ && aligned && round_up(nbytes, kAlign) <= block.capacity();
  const size_t io = direct ? round_up(nbytes, kAlign) : nbytes;
  if (max_bytes_ > 0 && usage_->bytes.load() + io > max_bytes_) return nullptr;
  usage_->bytes.fetch_add(io);
  usage_->files.fetch_add(1);
  st_.peak_disk_bytes = std::max<uint64_t>(st_.peak_disk_bytes, usage_->bytes.load());
  return std::make_shared<SpillFile>(dir, usage_, std::to_string(next_file_.fetch_add(1)) + ".bin", nbytes, direct);
}

SpillJobPtr SpillTier::queue(SpillJobPtr job, EventPtr after) {
  job->after_ = std::move(after);
  // Process-wide: the simulated runtime's observer knows the I/O of every tier by this number.
  static std::atomic<uint64_t> next_io{1};
  job->io_ = next_io.fetch_add(1);
  std::shared_ptr<DiskObserver> observer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    observer = observer_;
  }
  if (observer) observer->queued(job->io_, job->ptr_, job->file_->io_bytes(), job->write_, job->handle_);
  job->owner_ = getpid();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_ && job->owner_ == owner_) {
      (job->write_ ? writes_ : reads_).push_back(job);
      cv_.notify_one();
      return job;
    }
  }
  execute(*job);  // stopped, or a forked child: the workers may be gone, or were never its own
  return job;
}

SpillJobPtr SpillTier::write(std::shared_ptr<SpillFile> file, std::shared_ptr<HostBlock> block, EventPtr after,
                             uint64_t handle) {
  auto job = std::make_shared<SpillJob>();
  job->write_ = true;
  job->handle_ = handle;
  job->file_ = std::move(file);
  job->ptr_ = block->data();
  job->capacity_ = block->capacity();
  bool early = false, skip = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    early = release_early_;
    skip = skip_after_;
  }
  if (!early) job->block_ = std::move(block);  // else (broken protocol) dropped at the end of this call
  return queue(job, skip ? nullptr : std::move(after));
}

SpillJobPtr SpillTier::read(std::shared_ptr<SpillFile> file, std::shared_ptr<HostBlock> block, EventPtr after,
                            uint64_t handle) {
  auto job = std::make_shared<SpillJob>();
  job->write_ = false;
  job->handle_ = handle;
  job->file_ = std::move(file);
  job->ptr_ = block->data();
  job->capacity_ = block->capacity();
  job->block_ = std::move(block);
  return queue(job, std::move(after));
}

void SpillTier::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // While a fork() waits, no job is taken (nor does a stopped worker leave): the waiting thread
    // holds mu_ across it once busy_ is 0.
    cv_.wait(lock, [this] { return !fork_pending_ && (stop_ || !reads_.empty() || !writes_.empty()); });
    if (reads_.empty() && writes_.empty()) return;  // stopped and drained
    auto& q = reads_.empty() ? writes_ : reads_;
    SpillJobPtr job = std::move(q.front());
    q.pop_front();
    ++busy_;
    const int64_t linger = linger_us_;
    lock.unlock();
    execute(*job);
    job.reset();  // drops what the job still holds outside the lock (a block goes back to the pool)
    if (linger > 0) std::this_thread::sleep_for(std::chrono::microseconds(linger));
    lock.lock();
    if (--busy_ == 0 && fork_pending_) idle_cv_.notify_all();
  }
}

void SpillTier::quiesce_for_fork() {
  std::unique_lock<std::mutex> lock(mu_);
  fork_pending_ = true;
  // Bounded, so that a worker stuck in the kernel cannot hang the parent: past it the child may find
  // a lock held, as it would without this wait.
  idle_cv_.wait_for(lock, std::chrono::seconds(30), [this] { return busy_ == 0; });
  lock.release();  // mu_ stays locked across fork()
}

void SpillTier::resume_after_fork(bool child) {
  fork_pending_ = false;
  if (child) {
    // The child's copies of the condition variables still count the parent's workers as waiters
    // (a worker left in the older wait group after a notify_one): glibc's next broadcast would wait
    // for them to leave, and its destroy for them to go, forever. No thread waits on them in the
    // child, so each starts afresh; the old state is overwritten, never destroyed.
    new (&cv_) std::condition_variable();
    new (&idle_cv_) std::condition_variable();
  }
  mu_.unlock();  // locked by this thread, which is the child's only one
  if (!child) cv_.notify_all();
}

void SpillTier::fork_prepare() {
  ForkList& list = fork_list();
  list.mu.lock();
  list.held.clear();
  for (auto& w : list.tiers) {
    if (auto t = w.lock()) list.held.push_back(std::move(t));
  }
  for (auto& t : list.held) t->quiesce_for_fork();
}

void SpillTier::fork_parent() {
  ForkList& list = fork_list();
  for (auto& t : list.held) t->resume_after_fork(false);
  list.held.clear();
  list.mu.unlock();
}

void SpillTier::fork_child() {
  ForkList& list = fork_list();
  for (auto& t : list.held) t->resume_after_fork(true);
  list.held.clear();
  list.mu.unlock();
}

void SpillTier::execute(SpillJob& job) {
  if (job.cancelled_.load()) {
    finish(job, ECANCELED, "cancelled");
    return;
  }
  std::shared_ptr<DiskObserver> observer;
  int64_t delay_us = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    observer = observer_;
    // At least half the maximum: a test that sets a long delay knows the I/O is still running meanwhile.
    if (delay_max_us_ > 0) delay_us = std::uniform_int_distribution<int64_t>(delay_max_us_ / 2, delay_max_us_)(rng_);
  }
  std::string msg;
  int err = 0;
  try {
    if (job.after_) job.after_->synchronize();  // a write reads what the offload copy put in the block
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    if (observer) observer->started(job.io_);
  } catch (const std::exception& e) {
    err = EIO;
    msg = e.what();
  }
  if (err == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    do_io(job, msg, err);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> lock(mu_);
    if (job.write_) {
      st_.write_ms += ms;
      if (err == 0) {
        st_.tensors_spilled += 1;
        st_.bytes_spilled += job.file_->nbytes();
      }
    } else {
      st_.read_ms += ms;
      if (err == 0) {
        st_.tensors_read += 1;
        st_.bytes_read += job.file_->nbytes();
      }
    }
  }
  finish(job, err, std::move(msg));
}

bool SpillTier::do_io(SpillJob& job, std::string& msg, int& err) {
  const SpillFile& f = *job.file_;
  const char* what = job.write_ ? "writing a spilled tensor to" : "reading a spilled tensor from";
  auto fail = [&](int e, const std::string& detail) {
    err = e;
    msg = std::string("ckpt_offload: ") + what + " '" + f.path() + "' failed: " + detail;
    return false;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t& countdown = job.write_ ? fail_write_in_ : fail_read_in_;
    if (countdown > 0 && --countdown == 0) {
      return fail(job.write_ ? fail_write_err_ : fail_read_err_,
                  errno_text(job.write_ ? fail_write_err_ : fail_read_err_) + " (injected)");
    }
  }
  // O_DIRECT needs an aligned buffer and length; a block that cannot give both goes buffered.
  const size_t len = f.io_bytes();
  const bool direct = f.direct() && len <= job.capacity_ && reinterpret_cast<uintptr_t>(job.ptr_) % kAlign == 0;
  const size_t n = direct ? len : f.nbytes();
  char* p = static_cast<char*>(job.ptr_);
  // The padding up to the alignment is the block's own memory past the tensor: whatever an earlier
  // tensor left there. Zeroed, so that no stale bytes of another tensor go to the file.
  if (job.write_ && n > f.nbytes()) std::memset(p + f.nbytes(), 0, n - f.nbytes());
  const int flags = (job.write_ ? O_WRONLY | O_CREAT | O_TRUNC : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW | (direct ? O_DIRECT : 0);
  // Through the per-process directory's descriptor, by the name the tier made: never by path.
  const int dir_fd = f.dir_fd();
  int fd = openat(dir_fd, f.name().c_str(), flags, 0600);
  if (fd < 0) return fail(errno, errno_text(errno));
  auto drop_written = [&] {
    if (job.write_ && f.dir_->owned()) unlinkat(dir_fd, f.name().c_str(), 0);
  };
  struct stat sb {};
  if (!job.write_ && (fstat(fd, &sb) != 0 || static_cast<size_t>(sb.st_size) < f.io_bytes())) {
    close(fd);
    return fail(EIO, "the file is shorter than the tensor (truncated?)");
  }
  size_t done = 0;
  bool still_direct = direct;
  while (done < n) {
    const ssize_t r = job.write_ ? pwrite(fd, p + done, n - done, static_cast<off_t>(done))
                                 : pread(fd, p + done, n - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    // O_DIRECT answers EINVAL where a limit cut the transfer to an unaligned length, or after a
    // short one left an unaligned offset, hiding the real cause (ENOSPC, EFBIG). The rest goes
    // buffered, so that the real error, if any, comes out.
    if (r < 0 && errno == EINVAL && still_direct) {
      const int fl = fcntl(fd, F_GETFL);
      if (fl >= 0 && fcntl(fd, F_SETFL, fl & ~O_DIRECT) == 0) {
        still_direct = false;
        continue;
      }
    }
    if (r < 0) {
      const int e = errno;
      close(fd);
      drop_written();
      return fail(e, errno_text(e));
    }
    if (r == 0) {
      close(fd);
      drop_written();
      return fail(EIO, job.write_ ? "the write made no progress" : "the file is shorter than the tensor (truncated?)");
    }
    done += static_cast<size_t>(r);  // after a short direct transfer the next call is the EINVAL above
  }
  if (close(fd) != 0) {
    const int e = errno;
    drop_written();
    return fail(e, errno_text(e));
  }
  return true;
}

void SpillTier::finish(SpillJob& job, int err, std::string msg) {
  std::shared_ptr<DiskObserver> observer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    observer = observer_;
    if (err != 0 && err != ECANCELED) {
      if (job.write_) {
        st_.write_errors += 1;
        failed_.store(true);  // the disk is full or gone: tensors stay where they are from now on
      } else {
        st_.read_errors += 1;
      }
    }
  }
  // The observer hears of the end before the block can be handed out again.
  if (observer) observer->finished(job.io_);
  std::shared_ptr<HostBlock> drop;
  std::shared_ptr<SpillFile> file;
  {
    std::lock_guard<std::mutex> lock(job.mu_);
    // A written block goes back to the pool when the engine sees the write done (take_block), so that
    // "done" and "block free" are one event to it; after a failed write the block keeps the tensor's
    // only copy. A failed or cancelled read's block has nothing worth keeping.
    if ((!job.write_ && err != 0) || err == ECANCELED) drop = std::move(job.block_);
    // The file stays while its handle holds it; the job, which may be kept longer, lets go.
    file = std::move(job.file_);
  }
  // Before done: whoever sees the job done sees its block and file let go (a file with no handle
  // left is gone by then).
  drop.reset();
  file.reset();
  {
    std::lock_guard<std::mutex> lock(job.mu_);
    job.err_ = err;
    job.msg_ = std::move(msg);
    job.done_.store(true, std::memory_order_release);
  }
  job.cv_.notify_all();
}

SpillStats SpillTier::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  SpillStats out = st_;
  out.read_waits = read_waits_.load();
  out.write_waits = write_waits_.load();
  out.reads_over_cap = reads_over_cap_.load();
  out.reads_ahead = reads_ahead_.load();
  out.files = usage_->files.load();
  out.disk_bytes = usage_->bytes.load();
  out.failed = failed_.load();
  out.workers_busy = static_cast<uint64_t>(busy_);
  return out;
}

void SpillTier::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  const bool direct = st_.direct;
  st_ = SpillStats();
  st_.direct = direct;
  st_.max_bytes = max_bytes_;
  st_.peak_disk_bytes = usage_->bytes.load();
  read_waits_ = 0;
  write_waits_ = 0;
  reads_over_cap_ = 0;
  reads_ahead_ = 0;
}

void SpillTier::inject_fault(bool write, uint64_t nth, int err) {
  std::lock_guard<std::mutex> lock(mu_);
  (write ? fail_write_in_ : fail_read_in_) = nth;
  (write ? fail_write_err_ : fail_read_err_) = err;
}

void SpillTier::set_test_hooks(std::shared_ptr<DiskObserver> observer, int64_t max_us, uint64_t seed,
                               bool release_early, bool skip_after) {
  std::lock_guard<std::mutex> lock(mu_);
  observer_ = std::move(observer);
  delay_max_us_ = max_us;
  rng_.seed(seed);
  release_early_ = release_early;
  skip_after_ = skip_after;
}

void SpillTier::set_worker_linger(int64_t us) {
  std::lock_guard<std::mutex> lock(mu_);
  linger_us_ = us;
}

}  // namespace ckpt_offload

// The disk tier: the per-process spill directory (made, probed for O_DIRECT, removed at exit, never
// another process's), one file per spilled tensor, and the worker threads that write and read them.
#include "spill.h"

#include <dirent.h>
#include <fcntl.h>
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

namespace ckpt_offload {

namespace {

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Per-process directories still on disk, with the process that made each: removed at exit by that
// process only (a child forked after set_spill_dir inherits the list but not the directories).
struct ExitList {
  std::mutex mu;
  std::map<std::string, pid_t> dirs;
};

ExitList& exit_list() {
  static auto* list = new ExitList();  // leaked: used by the atexit handler
  return *list;
}

// Only what this process put there: files directly inside its own directory, then the directory.
void remove_tree(const std::string& path) {
  if (DIR* d = opendir(path.c_str())) {
    while (dirent* e = readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      unlink((path + "/" + e->d_name).c_str());
    }
    closedir(d);
  }
  rmdir(path.c_str());
}

void remove_at_exit() {
  ExitList& list = exit_list();
  std::lock_guard<std::mutex> lock(list.mu);
  for (const auto& kv : list.dirs) {
    if (kv.second == getpid()) remove_tree(kv.first);
  }
  list.dirs.clear();
}

void register_for_exit(const std::string& path) {
  static const bool registered = [] { return std::atexit(remove_at_exit) == 0; }();
  (void)registered;
  ExitList& list = exit_list();
  std::lock_guard<std::mutex> lock(list.mu);
  list.dirs[path] = getpid();
}

void unregister_for_exit(const std::string& path) {
  ExitList& list = exit_list();
  std::lock_guard<std::mutex> lock(list.mu);
  list.dirs.erase(path);
}

// mkdtemp <dir>/ckpt_offload-<pid>-XXXXXX; "" and err set on failure.
std::string make_process_dir(const std::string& dir, int& err) {
  std::string templ = dir + "/ckpt_offload-" + std::to_string(getpid()) + "-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    err = errno;
    return std::string();
  }
  return std::string(buf.data());
}

// Whether O_DIRECT works in `dir`: tmpfs and some network filesystems refuse it at open (EINVAL);
// others accept the open and refuse the I/O. One aligned block written and read back decides.
bool probe_direct(const std::string& dir) {
  const std::string path = dir + "/probe";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600);
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
  unlink(path.c_str());
  return ok;
}

}  // namespace

// The per-process directory; every file holds it, so it goes when the tier and the files have.
class SpillDir {
 public:
  explicit SpillDir(std::string path) : path(std::move(path)) { register_for_exit(this->path); }
  ~SpillDir() {
    remove_tree(path);  // empty by now unless a file could not be removed
    unregister_for_exit(path);
  }
  const std::string path;
};

// ---------------------------------------------------------------------------------------------
// SpillFile, SpillJob

SpillFile::SpillFile(std::shared_ptr<SpillDir> dir, std::shared_ptr<DiskUsage> usage, std::string path,
                     size_t nbytes, bool direct)
    : dir_(std::move(dir)), usage_(std::move(usage)), path_(std::move(path)), nbytes_(nbytes), direct_(direct) {}

SpillFile::~SpillFile() {
  unlink(path_.c_str());  // ENOENT when never written or already gone: nothing to do
  usage_->bytes.fetch_sub(io_bytes());
  usage_->files.fetch_sub(1);
}

size_t SpillFile::io_bytes() const { return direct_ ? round_up(nbytes_, SpillTier::kAlign) : nbytes_; }

void SpillJob::wait() {
  if (done()) return;
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
  struct stat sb {};
  if (stat(dir.c_str(), &sb) != 0) {
    const int err = errno;
    throw SpillPathError(where + (err == ENOENT ? " does not exist" : " cannot be examined: " + errno_text(err)));
  }
  if (!S_ISDIR(sb.st_mode)) throw SpillPathError(where + " is not a directory");
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    throw SpillPathError(where + " is not writable: " + errno_text(errno));
  }
  if (read_ahead < 0 || spill_ahead < 0 || threads < 1) {
    throw std::invalid_argument("set_spill_dir: read_ahead and spill_ahead must be >= 0");
  }
  std::shared_ptr<SpillTier> tier(new SpillTier(dir, max_bytes, read_ahead, spill_ahead));
  int err = 0;
  const std::string proc = make_process_dir(dir, err);
  if (proc.empty()) throw SpillPathError(where + " is not writable: cannot make a directory in it: " + errno_text(err));
  tier->dir_ = std::make_shared<SpillDir>(proc);
  // A real write as well (root passes access(), a read-only filesystem does not pass this).
  const std::string probe = proc + "/probe";
  int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || ::write(fd, "x", 1) != 1) {
    err = errno;
    if (fd >= 0) close(fd);
    unlink(probe.c_str());
    throw SpillPathError(where + " is not writable: " + errno_text(err));
  }
  close(fd);
  unlink(probe.c_str());
  tier->direct_ = probe_direct(proc);
  tier->st_.direct = tier->direct_;
  for (int i = 0; i < threads; ++i) std::thread([self = tier] { self->run(); }).detach();
  return tier;
}

SpillTier::SpillTier(std::string dir, uint64_t max_bytes, int read_ahead, int spill_ahead)
    : user_dir_(std::move(dir)), max_bytes_(max_bytes), read_ahead_(read_ahead), spill_ahead_(spill_ahead) {
  st_.max_bytes = max_bytes;
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
    int err = 0;
    const std::string proc = make_process_dir(user_dir_, err);
    if (proc.empty()) {
      dir_error_ = "cannot make a directory in '" + user_dir_ + "': " + errno_text(err);
      return nullptr;
    }
    dir_ = std::make_shared<SpillDir>(proc);
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
  const std::string path = dir->path + "/" + std::to_string(next_file_.fetch_add(1)) + ".bin";
  return std::make_shared<SpillFile>(dir, usage_, path, nbytes, direct);
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      (job->write_ ? writes_ : reads_).push_back(job);
      cv_.notify_one();
      return job;
    }
  }
  execute(*job);  // stopped: the workers may be gone
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
    cv_.wait(lock, [this] { return stop_ || !reads_.empty() || !writes_.empty(); });
    if (reads_.empty() && writes_.empty()) return;  // stopped and drained
    auto& q = reads_.empty() ? writes_ : reads_;
    SpillJobPtr job = std::move(q.front());
    q.pop_front();
    lock.unlock();
    execute(*job);
    job.reset();  // drops what the job still holds outside the lock (a block goes back to the pool)
    lock.lock();
  }
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
  int flags = (job.write_ ? O_WRONLY | O_CREAT | O_TRUNC : O_RDONLY) | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd = open(f.path().c_str(), flags, 0600);
  if (fd < 0) return fail(errno, errno_text(errno));
  struct stat sb {};
  if (!job.write_ && (fstat(fd, &sb) != 0 || static_cast<size_t>(sb.st_size) < f.io_bytes())) {
    close(fd);
    return fail(EIO, "the file is shorter than the tensor (truncated?)");
  }
  char* p = static_cast<char*>(job.ptr_);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = job.write_ ? pwrite(fd, p + done, n - done, static_cast<off_t>(done))
                                 : pread(fd, p + done, n - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int e = errno;
      close(fd);
      if (job.write_) unlink(f.path().c_str());
      return fail(e, errno_text(e));
    }
    if (r == 0) {
      close(fd);
      return fail(EIO, job.write_ ? "the write made no progress" : "the file is shorter than the tensor (truncated?)");
    }
    done += static_cast<size_t>(r);
  }
  if (close(fd) != 0) {
    const int e = errno;
    if (job.write_) unlink(f.path().c_str());
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

}  // namespace ckpt_offload

// The disk tier under the host pool: pool blocks written to files of a per-process directory and read
// back into pool blocks, by worker threads with pwrite/pread (O_DIRECT where the filesystem allows it).
// No torch dependency; the copy engine decides what goes to disk and when (copy_engine.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "cuda_util.h"
#include "host_pool.h"

namespace ckpt_offload {

// A path that cannot hold spill files: missing, not a directory, not writable.
class SpillPathError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct SpillStats {
  uint64_t tensors_spilled = 0;  // writes that completed
  uint64_t bytes_spilled = 0;    // their tensor bytes
  uint64_t tensors_read = 0;     // reads that completed
  uint64_t bytes_read = 0;
  double write_ms = 0.0;         // worker time inside open/pwrite/close
  double read_ms = 0.0;          // worker time inside open/pread/close
  uint64_t reads_ahead = 0;      // reads started ahead of their reload (CopyEngine::read_ahead)
  uint64_t read_waits = 0;       // reloads whose read had not completed when the reload needed it
  uint64_t write_waits = 0;      // offloads that waited for a write to free a pool block
  uint64_t reads_over_cap = 0;   // reads that needed a block past the pool's cap (see CopyEngine)
  uint64_t write_errors = 0;     // failed writes: their tensors stayed where they were
  uint64_t read_errors = 0;      // failed reads: the step that needed them raised
  uint64_t files = 0;            // files that exist now (or are being written)
  uint64_t disk_bytes = 0;       // bytes those files take
  uint64_t peak_disk_bytes = 0;  // the most disk_bytes since creation or reset_stats()
  uint64_t max_bytes = 0;        // 0 = no budget
  uint64_t workers_busy = 0;     // workers between taking a job and returning to the queue
  bool direct = false;           // O_DIRECT (else buffered I/O)
  bool failed = false;           // a write failed: no further spilling until set_spill_dir again
};

// The simulated runtime's view of the disk stage: which pool memory a queued I/O uses, so that it can
// report copies that touch it unordered (runtime_sim.cpp). May throw from started(): the I/O then fails.
class DiskObserver {
 public:
  virtual ~DiskObserver() = default;
  // write: the disk reads [ptr, ptr + n) (block -> file); else it writes it (file -> block).
  virtual void queued(uint64_t io, const void* ptr, size_t n, bool write, uint64_t handle) = 0;
  virtual void started(uint64_t io) = 0;
  virtual void finished(uint64_t io) = 0;
};

class SpillDir;

// Bytes and files on disk, shared by the tier and its files (which may outlive it).
struct DiskUsage {
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> files{0};
};

// One tensor's file. The file is removed when the last reference goes (the handle fetched or
// released, and no I/O on it queued).
class SpillFile {
 public:
  // name: the file's name in the per-process directory, which it is only ever opened through.
  SpillFile(std::shared_ptr<SpillDir> dir, std::shared_ptr<DiskUsage> usage, std::string name, size_t nbytes,
            bool direct);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;
  const std::string& path() const { return path_; }  // absolute, for messages
  const std::string& name() const { return name_; }
  int dir_fd() const;
  size_t nbytes() const { return nbytes_; }
  bool direct() const { return direct_; }  // O_DIRECT for this file (aligned length fits its block)
  size_t io_bytes() const;                 // bytes moved: nbytes, rounded up to the alignment if direct

 private:
  friend class SpillTier;
  std::shared_ptr<SpillDir> dir_;
  std::shared_ptr<DiskUsage> usage_;
  const std::string name_;
  const std::string path_;
  const size_t nbytes_;
  const bool direct_;
};

// One write (block -> file) or read (file -> block) on a worker thread.
class SpillJob {
 public:
  bool write() const { return write_; }
  bool done() const { return done_.load(std::memory_order_acquire); }
  void wait();                    // host wait until done()
  bool failed() const { return err_ != 0; }  // valid once done()
  int error_number() const { return err_; }
  const std::string& message() const { return msg_; }
  // The block: after a failed write, the data still in it; after a read, the data read. Once done().
  std::shared_ptr<HostBlock> take_block();
  // Testing aid (a broken protocol): the block while the read may still run.
  std::shared_ptr<HostBlock> peek_block();
  // A job not started yet is skipped; its block and file go at once.
  void cancel() { cancelled_.store(true); }

 private:
  friend class SpillTier;
  bool write_ = true;
  uint64_t io_ = 0;
  uint64_t handle_ = 0;
  std::shared_ptr<SpillFile> file_;
  std::shared_ptr<HostBlock> block_;
  void* ptr_ = nullptr;   // the block's memory, kept apart for the broken "release early" protocol
  size_t capacity_ = 0;
  EventPtr after_;        // a write waits for the copy that fills the block; a read for the last reader
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> done_{false};
  pid_t owner_ = 0;       // the process that queued it (a forked child cannot wait for it)
  int err_ = 0;
  std::string msg_;
  std::mutex mu_;
  std::condition_variable cv_;
};

using SpillJobPtr = std::shared_ptr<SpillJob>;

class SpillTier : public std::enable_shared_from_this<SpillTier> {
 public:
  static constexpr size_t kAlign = 4096;  // O_DIRECT buffers, offsets and lengths
  // Checks `dir` (an existing, writable directory that no other user may rename entries in), creates
  // <dir>/ckpt_offload-<pid>-XXXXXX in it and probes O_DIRECT there. Throws SpillPathError naming the
  // path and the reason. A relative `dir` is made absolute now; both folders are held by descriptors.
  // max_bytes: the disk budget, 0 = none. read_ahead: layers a read starts ahead of the reload
  // (the session walks them). spill_ahead: writes started ahead of need (0: only on demand).
  static std::shared_ptr<SpillTier> create(const std::string& dir, uint64_t max_bytes, int read_ahead,
                                           int spill_ahead, int threads = 2);
  // The workers hold the tier until stop() (the pool calls it when it lets the tier go): they may
  // return the last block of a pool, so the pool's destruction may run on one of them. A stopped
  // tier spills nothing new; the reads its files still need run on the caller's thread.
  void stop();
  SpillTier(const SpillTier&) = delete;
  SpillTier& operator=(const SpillTier&) = delete;
  ~SpillTier();

  // A new file for a tensor of nbytes held in `block`, or nullptr when the budget refuses or spilling
  // stopped after a write error.
  std::shared_ptr<SpillFile> new_file(size_t nbytes, const HostBlock& block);
  // Queues block -> file after `after` (the copy that filled the block) completed. The block goes
  // back to the pool when the write completed; after a failure the job keeps it (take_block).
  SpillJobPtr write(std::shared_ptr<SpillFile> file, std::shared_ptr<HostBlock> block, EventPtr after,
                    uint64_t handle);
  // Queues file -> block after `after` (a copy still reading the reused block) completed.
  SpillJobPtr read(std::shared_ptr<SpillFile> file, std::shared_ptr<HostBlock> block, EventPtr after,
                   uint64_t handle);

  bool usable() const { return !failed_.load(); }
  bool direct() const { return direct_; }
  int read_ahead() const { return read_ahead_; }
  int spill_ahead() const { return spill_ahead_; }
  const std::string& dir() const;           // the user's directory, absolute
  std::string process_dir() const;          // the per-process directory under it ("" while removed)
  // Removes the per-process directory when no file is left in it (made again by the next spill).
  void remove_dir_if_empty();

  SpillStats stats();
  void reset_stats();
  void note_read_wait() { read_waits_.fetch_add(1); }
  void note_read_ahead() { reads_ahead_.fetch_add(1); }
  void note_write_wait() { write_waits_.fetch_add(1); }
  void note_read_over_cap() { reads_over_cap_.fetch_add(1); }

  // Testing aids. The nth next write (or read) from now fails with errno err (n >= 1; 0 clears).
  void inject_fault(bool write, uint64_t nth, int err);
  // The simulated runtime: its observer, a random delay of max_us / 2 to max_us before each I/O (seeded),
  // and two broken rules: release_early (a written block goes back to the pool when its write is
  // queued) and skip_after (a write does not wait for the copy that fills its block).
  void set_test_hooks(std::shared_ptr<DiskObserver> observer, int64_t max_us, uint64_t seed, bool release_early,
                      bool skip_after);
  // Testing aid: each worker waits this long after a job before it returns to the queue (a worker
  // the scheduler set aside at the wrong moment, as on a loaded machine).
  void set_worker_linger(int64_t us);

  // fork(): every live tier's workers are brought to rest first, so that none holds a lock (the
  // pool's, a job's, the exit list's) or is halfway through a queue in the child, where it would
  // never let go. Registered with pthread_atfork by the first create().
  static void fork_prepare();
  static void fork_parent();
  static void fork_child();

 private:
  SpillTier(std::string dir, int user_fd, uint64_t max_bytes, int read_ahead, int spill_ahead);
  SpillJobPtr queue(SpillJobPtr job, EventPtr after);
  void run();
  void execute(SpillJob& job);
  bool do_io(SpillJob& job, std::string& msg, int& err);
  void finish(SpillJob& job, int err, std::string msg);
  std::shared_ptr<SpillDir> current_dir();  // caller holds mu_

  const std::string user_dir_;
  const int user_fd_;    // the user's directory, opened once
  const pid_t owner_;    // the process that made the tier and its workers
  const uint64_t max_bytes_;
  const int read_ahead_;
  const int spill_ahead_;
  bool direct_ = false;
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> next_file_{1};
  std::atomic<uint64_t> next_io_{1};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SpillJobPtr> reads_, writes_;  // reads first: backward waits for them
  bool stop_ = false;
  std::shared_ptr<SpillDir> dir_;           // under mu_; files hold it too
  std::string dir_error_;                   // why the last attempt to make it failed
  int busy_ = 0;                            // under mu_: workers outside it with a job
  bool fork_pending_ = false;               // under mu_: workers take no job while a fork() waits
  std::condition_variable idle_cv_;         // busy_ fell to 0 while a fork() waits
  int64_t linger_us_ = 0;                   // under mu_ (set_worker_linger)
  void quiesce_for_fork();                  // returns with mu_ held
  void resume_after_fork(bool child);       // releases it

  // Statistics (under mu_ unless atomic).
  SpillStats st_;
  std::atomic<uint64_t> read_waits_{0}, write_waits_{0}, reads_over_cap_{0}, reads_ahead_{0};
  std::shared_ptr<DiskUsage> usage_ = std::make_shared<DiskUsage>();

  // Faults and test hooks (under mu_).
  uint64_t fail_write_in_ = 0, fail_read_in_ = 0;
  int fail_write_err_ = 0, fail_read_err_ = 0;
  std::shared_ptr<DiskObserver> observer_;
  int64_t delay_max_us_ = 0;
  std::mt19937_64 rng_;
  bool release_early_ = false, skip_after_ = false;
};

}  // namespace ckpt_offload

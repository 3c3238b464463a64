/* SPSC ring indices in a shared segment: free-running uint32 counters, the producer
 * publishes with a release store, the consumer observes with an acquire load. The
 * other side's index is untrusted: callers bound (tail - head) by the capacity. */
#ifndef KD_IPC_IPC_RING_H
#define KD_IPC_IPC_RING_H

#include <stdatomic.h>
#include <stdint.h>

/* A hint inside spin loops. */
#if defined(__x86_64__) || defined(__i386__)
#define ipc_cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define ipc_cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define ipc_cpu_relax() atomic_signal_fence(memory_order_seq_cst)
#endif

static inline uint32_t ipc_load_acquire(_Atomic uint32_t *p)
{
	return atomic_load_explicit(p, memory_order_acquire);
}

static inline void ipc_store_release(_Atomic uint32_t *p, uint32_t v)
{
	atomic_store_explicit(p, v, memory_order_release);
}

/* Records in flight between head and tail, or -1 when the pair is impossible for a
 * ring of cap slots (a corrupted or hostile index). */
static inline int64_t ipc_ring_used(uint32_t head, uint32_t tail, uint32_t cap)
{
	uint32_t used = tail - head;

	return used <= cap ? (int64_t)used : -1;
}

#endif

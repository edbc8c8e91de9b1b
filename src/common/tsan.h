/* ThreadSanitizer and the memory peers read and write.
 *
 * TSan follows the threads of one process. A transport's server thread reads
 * and writes registered memory on a peer's behalf, when the peer asks; the
 * peer orders those accesses with the owner's own through its own protocol (a
 * pipe announces a buffer before the peer READs it and is told by an ACK when
 * it is done), across processes, where TSan cannot follow, as it cannot
 * follow a NIC's DMA. So those copies are hidden from it, as DMA would be;
 * every other access, the engine's own state included, stays checked. Without
 * TSan these are no-ops. */
#ifndef KVPI_COMMON_TSAN_H
#define KVPI_COMMON_TSAN_H

#if defined(__SANITIZE_THREAD__)
#define KVPI_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVPI_TSAN 1
#endif
#endif

#ifdef KVPI_TSAN
/* The TSan runtime's dynamic annotations. */
void AnnotateIgnoreReadsBegin(const char *file, int line);
void AnnotateIgnoreReadsEnd(const char *file, int line);
void AnnotateIgnoreWritesBegin(const char *file, int line);
void AnnotateIgnoreWritesEnd(const char *file, int line);
/* Around a copy into or out of registered memory made for a peer. */
#define KVPI_PEER_COPY_BEGIN()                                                                     \
    (AnnotateIgnoreReadsBegin(__FILE__, __LINE__), AnnotateIgnoreWritesBegin(__FILE__, __LINE__))
#define KVPI_PEER_COPY_END()                                                                       \
    (AnnotateIgnoreWritesEnd(__FILE__, __LINE__), AnnotateIgnoreReadsEnd(__FILE__, __LINE__))
#else
#define KVPI_PEER_COPY_BEGIN() ((void)0)
#define KVPI_PEER_COPY_END() ((void)0)
#endif

#endif

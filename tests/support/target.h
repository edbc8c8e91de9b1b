/* A target engine in a child process, for multi-process engine tests.
 *
 * The buffer is a MAP_SHARED anonymous mapping made before the fork, so the
 * test (the initiator, in the parent) can check what its WRITEs put into the
 * target's memory without another protocol; the bytes themselves still cross
 * between the two processes through the engine's transport. */
#ifndef KVPT_TARGET_H
#define KVPT_TARGET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct kvpt_target {
    pid_t pid;
    char name[64]; /* segment name, "127.0.0.1:port" */
    void *buf;     /* shared with the child; registered there */
    size_t len;
    int ctl; /* write end of the control pipe: closing it stops the child */
} kvpt_target;

typedef struct kvpt_target_opts {
    const char *metadata; /* connection string */
    const char *protocol; /* NULL: tcp */
    int port;             /* 0: a free port */
    size_t len;           /* buffer bytes */
    uint64_t seed;        /* kvpt_fill pattern of the buffer */
    int disable_shm;
} kvpt_target_opts;

/* Start the child and wait until its segment is published. 0 on success. */
int kvpt_target_start(const kvpt_target_opts *opts, kvpt_target *out);

/* Stop it cleanly (engine destroyed, segment unpublished); returns its exit
 * status. The shared buffer is unmapped unless keep_buffer. */
int kvpt_target_stop(kvpt_target *t, int keep_buffer);

/* SIGKILL it (no cleanup: the metadata store keeps its stale descriptor). */
void kvpt_target_kill(kvpt_target *t);

/* An initiator engine in this process with a free port. */
struct kvp_engine;
int kvpt_engine_start(const char *metadata, const char *protocol, int disable_shm,
                      struct kvp_engine **out);

/* A `kvpipe metadata-server` process on a free port; fills url
 * ("http://127.0.0.1:P/metadata"). Returns its pid or -1. */
pid_t kvpt_http_store_start(char *url, size_t len);

#endif

/* A pipe's metrics: its counters (kvp_pipe_get_stats, and its timeouts) as
 * samples, followed by its engine's. */
#include "common/error.h"
#include "common/metrics.h"
#include "engine/metrics.h"
#include "kvpipe/pipe.h"
#include "pipe/pipe_metrics.h"

static const kvpi_metric_family
    f_messages = {"kvpipe_pipe_messages_total",
                  "Tensors (None included) sent or received through the pipe, by direction",
                  KVP_METRIC_COUNTER},
    f_bytes = {"kvpipe_pipe_bytes_total", "Encoded message bytes sent or received, by direction",
               KVP_METRIC_COUNTER},
    f_acks = {"kvpipe_pipe_acks_total", "ACKs received for sent messages", KVP_METRIC_COUNTER},
    f_bad_messages = {"kvpipe_pipe_bad_messages_total",
                      "Announcements dropped as malformed or refused by recv", KVP_METRIC_COUNTER},
    f_bad_acks = {"kvpipe_pipe_bad_acks_total", "ACK frames dropped: not \"ACK\", or not expected",
                  KVP_METRIC_COUNTER},
    f_timeouts = {"kvpipe_pipe_timeouts_total",
                  "Sends and receives that ran out of time (KVP_ETIMEDOUT), by operation",
                  KVP_METRIC_COUNTER},
    f_corrupt = {"kvpipe_pipe_corrupt_total",
                 "Messages received whose bytes differ from the digest the sender took "
                 "(integrity on at both sides: handed out as ECORRUPT)",
                 KVP_METRIC_COUNTER},
    f_inflight_bytes = {"kvpipe_pipe_inflight_bytes", "Bytes sent and not yet acknowledged",
                        KVP_METRIC_GAUGE},
    f_inflight_messages = {"kvpipe_pipe_inflight_messages",
                           "Messages sent and not yet acknowledged", KVP_METRIC_GAUGE};

void kvpi_pipe_metrics_collect(kvp_pipe *p, kvp_metrics *m)
{
    kvp_pipe_stats s;
    kvp_pipe_get_stats(p, &s);
    kvpi_metrics_add(m, &f_messages, (double)s.sent, "direction", "sent", NULL);
    kvpi_metrics_add(m, &f_messages, (double)s.received, "direction", "received", NULL);
    kvpi_metrics_add(m, &f_bytes, (double)s.bytes_sent, "direction", "sent", NULL);
    kvpi_metrics_add(m, &f_bytes, (double)s.bytes_received, "direction", "received", NULL);
    kvpi_metrics_add(m, &f_acks, (double)s.acks, NULL);
    kvpi_metrics_add(m, &f_bad_messages, (double)s.bad_messages, NULL);
    kvpi_metrics_add(m, &f_bad_acks, (double)s.bad_acks, NULL);
    const kvpi_pipe_counters *c = kvpi_pipe_counters_of(p);
    kvpi_metrics_add(m, &f_timeouts, (double)kvpi_counter_get(&c->send_timeouts), "op", "send",
                     NULL);
    kvpi_metrics_add(m, &f_timeouts, (double)kvpi_counter_get(&c->recv_timeouts), "op", "recv",
                     NULL);
    kvpi_metrics_add(m, &f_corrupt, (double)kvpi_counter_get(&c->corrupt), NULL);
    kvpi_metrics_add(m, &f_inflight_bytes, (double)s.inflight_bytes, NULL);
    kvpi_metrics_add(m, &f_inflight_messages, (double)s.inflight_count, NULL);
}

kvp_status kvp_pipe_metrics(kvp_pipe *p, kvp_metrics **out)
{
    if (!p || !out) return kvpi_error(KVP_EINVAL, "pipe_metrics: NULL argument");
    kvp_metrics *m = kvpi_metrics_new();
    if (!m) return kvpi_error(KVP_ENOMEM, "pipe_metrics: out of memory");
    kvpi_pipe_metrics_collect(p, m);
    kvpi_engine_metrics_collect(kvp_pipe_engine(p), m);
    kvp_status st = kvpi_metrics_status(m);
    if (st) {
        kvp_metrics_free(m);
        return st;
    }
    *out = m;
    return KVP_OK;
}

void kvpi_pipe_metrics_serve(void *pipe, kvp_metrics *into)
{
    kvp_pipe *p = pipe;
    kvpi_metrics_base_labels(into, "engine", kvp_engine_segment_name(kvp_pipe_engine(p)), NULL);
    kvpi_pipe_metrics_collect(p, into);
    kvpi_metrics_base_labels(into, NULL);
}

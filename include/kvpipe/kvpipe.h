/* kvpipe: move KV-cache tensors between prefill and decode instances.
 * Umbrella header; see the headers it includes. */
#ifndef KVPIPE_KVPIPE_H
#define KVPIPE_KVPIPE_H

#include "kvpipe/status.h"
#include "kvpipe/version.h"
#include "kvpipe/log.h"
#include "kvpipe/engine.h"
#include "kvpipe/info.h"
#include "kvpipe/metadata_server.h"
#include "kvpipe/metrics.h"
#include "kvpipe/pipe.h"
#include "kvpipe/tensor.h"

#endif

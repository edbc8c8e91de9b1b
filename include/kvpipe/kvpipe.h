/* kvpipe: move KV-cache tensors between prefill and decode instances.
 * Umbrella header; see the headers it includes. */
#ifndef KVPIPE_KVPIPE_H
#define KVPIPE_KVPIPE_H

#include "kvpipe/status.h"
#include "kvpipe/log.h"
#include "kvpipe/engine.h"
#include "kvpipe/metadata_server.h"
#include "kvpipe/pipe.h"
#include "kvpipe/tensor.h"

#define KVP_VERSION_STRING "0.1.0"

#endif

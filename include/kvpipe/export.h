/* KVP_API marks the declarations libkvpipe.so exports. The library is built
 * with hidden visibility by default, so only what carries KVP_API (the public
 * kvp_ API) is seen by programs; everything internal stays inside. */
#ifndef KVPIPE_EXPORT_H
#define KVPIPE_EXPORT_H

#if defined(__GNUC__) || defined(__clang__)
#define KVP_API __attribute__((visibility("default")))
#else
#define KVP_API
#endif

#endif

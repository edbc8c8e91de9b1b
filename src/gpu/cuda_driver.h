/* The CUDA driver API's types and constants that kvpipe, its test double
 * (tests/support/fake_cuda) and the GPU suite (tests/gpu/gpu_check.c) use,
 * declared from NVIDIA's driver API reference: the toolkit's cuda.h is not
 * needed to build, and the driver is loaded at run time. Handles are opaque
 * pointers, CUdeviceptr a 64-bit integer, CUresult 0 on success. */
#ifndef KVPI_GPU_CUDA_DRIVER_H
#define KVPI_GPU_CUDA_DRIVER_H

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;

#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcMemHandle {
    char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_IS_MANAGED 8
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_HOST 1
#define CU_MEMORYTYPE_DEVICE 2
#define CU_MEMORYTYPE_ARRAY 3
#define CU_MEMORYTYPE_UNIFIED 4
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_MEMHOSTALLOC_PORTABLE 0x1
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1

#endif

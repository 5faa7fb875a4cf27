/* A fake libnvidia-ml.so.1 for tests on machines without GPUs: the calls the agent makes, on the C ABI.
 *
 * Controlled through files in $FAKE_NVML_DIR:
 *   cards          the number of cards (default 2); card k has UUID GPU-fake-000k
 *   lost-<k>       while it exists, card k answers NVML_ERROR_GPU_IS_LOST, and so does the event set's
 *                  wait (as the real one does, without saying which card)
 *   xid-<k>        holds an Xid number; the event set reports it once for card k, then deletes the file
 *   mig-<k>        while it exists, card k is in MIG mode
 *   compute-<k>    card k's compute mode (a number; absent: 0, Default); nvmlDeviceSetComputeMode writes it
 *   no-permission  while it exists, nvmlDeviceSetComputeMode answers NVML_ERROR_NO_PERMISSION
 *   driver         the driver version string (default 615.00-fake)
 * It also exports nvmlDeviceSetMemoryLimits_v1, as drivers that can cap a cgroup's memory do.
 *   procs-<k>      compute processes on card k, one "<pid> <MiB> [<SM %>]" a line; memory used is their
 *                  sum; a process with an SM % gives one utilization sample (none at all: NOT_FOUND)
 *   procutil-<k>   while it exists, card k answers NOT_SUPPORTED for process utilization
 *   util-<k>       card k's utilization in percent (default 0); "unsupported" answers NOT_SUPPORTED
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define XID_CRITICAL 0x8ULL

typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } process_t;
typedef struct { unsigned int gpu, memory; } utilization_t;
typedef struct { unsigned int pid; unsigned long long timeStamp; unsigned int smUtil, memUtil, encUtil, decUtil; }
    process_sample_t;
#define MAX_PROCS 256
typedef struct {
    void *device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} event_data_t;

static unsigned long long registered = 0; /* bit k: card k reports Xid events */

static const char *dir(void) {
    const char *d = getenv("FAKE_NVML_DIR");
    return d ? d : "/nonexistent";
}

static int card_count(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/cards", dir());
    FILE *f = fopen(path, "r");
    int n = 2;
    if (f) {
        if (fscanf(f, "%d", &n) != 1) n = 2;
        fclose(f);
    }
    return n;
}

static int lost(int k) {
    char path[512];
    snprintf(path, sizeof path, "%s/lost-%d", dir(), k);
    return access(path, F_OK) == 0;
}

static int index_of(void *handle) {
    intptr_t k = (intptr_t)handle - 1;
    return (k >= 0 && k < card_count()) ? (int)k : -1;
}

int nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
int nvmlInit_v2(void) { return NVML_SUCCESS; }
int nvmlShutdown(void) { return NVML_SUCCESS; }

const char *nvmlErrorString(int result) {
    switch (result) {
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

int nvmlDeviceGetCount_v2(unsigned int *count) { *count = (unsigned int)card_count(); return NVML_SUCCESS; }

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    if ((int)index >= card_count()) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost((int)index)) return NVML_ERROR_GPU_IS_LOST;
    *device = (void *)(intptr_t)(index + 1);
    return NVML_SUCCESS;
}

int nvmlDeviceGetHandleByUUID(const char *uuid, void **device) {
    int k;
    if (sscanf(uuid, "GPU-fake-%4d", &k) != 1 || k < 0 || k >= card_count()) return NVML_ERROR_NOT_FOUND;
    if (lost(k)) return NVML_ERROR_GPU_IS_LOST;
    *device = (void *)(intptr_t)(k + 1);
    return NVML_SUCCESS;
}

int nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(uuid, length, "GPU-fake-%04d", k);
    return NVML_SUCCESS;
}

int nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    if (index_of(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(name, length, "Fake GPU 16GB");
    return NVML_SUCCESS;
}

/* Card k's compute processes from procs-<k>; returns how many (at most MAX_PROCS). sm[i] is the
 * process's SM %, or -1 when its line gives none (sm may be NULL). */
static unsigned int read_procs_sm(int k, process_t *out, int *sm) {
    char path[512], line[256];
    unsigned int n = 0, pid;
    unsigned long long mib;
    int util;
    snprintf(path, sizeof path, "%s/procs-%d", dir(), k);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    while (n < MAX_PROCS && fgets(line, sizeof line, f)) {
        int got = sscanf(line, "%u %llu %d", &pid, &mib, &util);
        if (got < 2) continue;
        memset(&out[n], 0, sizeof out[n]);
        out[n].pid = pid;
        out[n].usedGpuMemory = mib << 20;
        if (sm) sm[n] = got == 3 ? util : -1;
        n++;
    }
    fclose(f);
    return n;
}

static unsigned int read_procs(int k, process_t *out) { return read_procs_sm(k, out, NULL); }

int nvmlDeviceGetMemoryInfo(void *device, memory_t *memory) {
    process_t procs[MAX_PROCS];
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(k)) return NVML_ERROR_GPU_IS_LOST;
    memory->total = 16ULL << 30;
    memory->used = 0;
    for (unsigned int i = 0, n = read_procs(k, procs); i < n; i++) memory->used += procs[i].usedGpuMemory;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

/* The NVML convention: too small an array answers INSUFFICIENT_SIZE with the count needed. */
int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, process_t *infos) {
    process_t procs[MAX_PROCS];
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(k)) return NVML_ERROR_GPU_IS_LOST;
    unsigned int n = read_procs(k, procs);
    if (n > *count || (n > 0 && infos == NULL)) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    memcpy(infos, procs, n * sizeof *procs);
    *count = n;
    return NVML_SUCCESS;
}

int nvmlDeviceGetGraphicsRunningProcesses_v3(void *device, unsigned int *count, process_t *infos) {
    (void)infos;
    if (index_of(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

int nvmlDeviceGetUtilizationRates(void *device, utilization_t *util) {
    char path[512], text[32] = "";
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(k)) return NVML_ERROR_GPU_IS_LOST;
    snprintf(path, sizeof path, "%s/util-%d", dir(), k);
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(text, sizeof text, f)) text[0] = 0;
        fclose(f);
    }
    if (strncmp(text, "unsupported", 11) == 0) return NVML_ERROR_NOT_SUPPORTED;
    util->gpu = (unsigned int)atoi(text);
    util->memory = 0;
    return NVML_SUCCESS;
}

int nvmlEventSetCreate(void **set) { *set = (void *)(intptr_t)1; return NVML_SUCCESS; }
int nvmlEventSetFree(void *set) { (void)set; return NVML_SUCCESS; }

int nvmlDeviceRegisterEvents(void *device, unsigned long long types, void *set) {
    int k = index_of(device);
    (void)set;
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (types & XID_CRITICAL) registered |= 1ULL << k;
    return NVML_SUCCESS;
}

int nvmlEventSetWait_v2(void *set, event_data_t *data, unsigned int timeout_ms) {
    struct timespec step = {0, 10 * 1000 * 1000};
    (void)set;
    for (unsigned int waited = 0;; waited += 10) {
        for (int k = 0; k < card_count(); k++)
            if ((registered & (1ULL << k)) && lost(k)) return NVML_ERROR_GPU_IS_LOST;
        for (int k = 0; k < card_count(); k++) {
            char path[512];
            int xid;
            if (!(registered & (1ULL << k))) continue;
            snprintf(path, sizeof path, "%s/xid-%d", dir(), k);
            FILE *f = fopen(path, "r");
            if (!f) continue;
            int got = fscanf(f, "%d", &xid);
            fclose(f);
            if (got != 1) continue;  /* still being written */
            unlink(path);
            memset(data, 0, sizeof *data);
            data->device = (void *)(intptr_t)(k + 1);
            data->eventType = XID_CRITICAL;
            data->eventData = (unsigned long long)xid;
            return NVML_SUCCESS;
        }
        if (waited >= timeout_ms) return NVML_ERROR_TIMEOUT;
        nanosleep(&step, NULL);
    }
}

static int control_file(const char *name, int k, char *path, size_t size) {
    if (k >= 0) return snprintf(path, size, "%s/%s-%d", dir(), name, k);
    return snprintf(path, size, "%s/%s", dir(), name);
}

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    char path[512];
    control_file("driver", -1, path, sizeof path);
    FILE *f = fopen(path, "r");
    snprintf(version, length, "615.00-fake");
    if (f) {
        if (!fgets(version, (int)length, f)) snprintf(version, length, "615.00-fake");
        version[strcspn(version, "\n")] = 0;
        fclose(f);
    }
    return NVML_SUCCESS;
}

int nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending) {
    char path[512];
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    control_file("mig", k, path, sizeof path);
    *current = *pending = access(path, F_OK) == 0 ? 1 : 0;
    return NVML_SUCCESS;
}

int nvmlDeviceGetComputeMode(void *device, int *mode) {
    char path[512];
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    control_file("compute", k, path, sizeof path);
    FILE *f = fopen(path, "r");
    *mode = 0;
    if (f) {
        if (fscanf(f, "%d", mode) != 1) *mode = 0;
        fclose(f);
    }
    return NVML_SUCCESS;
}

int nvmlDeviceSetComputeMode(void *device, int mode) {
    char path[512];
    int k = index_of(device);
    if (k < 0 || mode < 0 || mode > 3) return NVML_ERROR_INVALID_ARGUMENT;
    control_file("no-permission", -1, path, sizeof path);
    if (access(path, F_OK) == 0) return NVML_ERROR_NO_PERMISSION;
    control_file("compute", k, path, sizeof path);
    FILE *f = fopen(path, "w");
    if (!f) return NVML_ERROR_INVALID_ARGUMENT;
    fprintf(f, "%d\n", mode);
    fclose(f);
    return NVML_SUCCESS;
}

int nvmlDeviceSetMemoryLimits_v1(void *device, void *limits) {
    (void)limits;
    return index_of(device) < 0 ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
}
/* One sample per process with an SM % in procs-<k>, stamped 1000 + the line's position (microseconds),
 * so that asking again from the newest stamp gives nothing new: NOT_FOUND, as NVML answers. */
int nvmlDeviceGetProcessUtilization(void *device, process_sample_t *samples, unsigned int *count,
                                    unsigned long long lastSeen) {
    process_t procs[MAX_PROCS];
    int sm[MAX_PROCS];
    char path[512];
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(k)) return NVML_ERROR_GPU_IS_LOST;
    snprintf(path, sizeof path, "%s/procutil-%d", dir(), k);
    if (access(path, F_OK) == 0) return NVML_ERROR_NOT_SUPPORTED;
    unsigned int n = read_procs_sm(k, procs, sm), found = 0;
    process_sample_t out[MAX_PROCS];
    for (unsigned int i = 0; i < n; i++) {
        unsigned long long stamp = 1000 + i;
        if (sm[i] < 0 || stamp <= lastSeen) continue;
        memset(&out[found], 0, sizeof out[found]);
        out[found].pid = procs[i].pid;
        out[found].timeStamp = stamp;
        out[found].smUtil = (unsigned int)sm[i];
        found++;
    }
    if (found == 0) return NVML_ERROR_NOT_FOUND;
    if (samples == NULL || *count < found) { *count = found; return NVML_ERROR_INSUFFICIENT_SIZE; }
    memcpy(samples, out, found * sizeof *out);
    *count = found;
    return NVML_SUCCESS;
}

/* What NVIDIA's own k8s-device-plugin asks beyond the agent's calls (make e2e runs it on this library):
 * card k is minor k (/dev/nvidia<k>), on PCI bus 0x1k, compute capability 8.0 (an A100's). */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} pci_info_t;

int nvmlDeviceGetMinorNumber(void *device, unsigned int *minor) {
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned int)k;
    return NVML_SUCCESS;
}

int nvmlDeviceGetIndex(void *device, unsigned int *index) {
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)k;
    return NVML_SUCCESS;
}

int nvmlDeviceGetPciInfo_v3(void *device, pci_info_t *pci) {
    int k = index_of(device);
    if (k < 0) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->bus = 0x10u + (unsigned int)k;
    pci->pciDeviceId = 0x20b010deu;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

int nvmlDeviceGetCudaComputeCapability(void *device, int *major, int *minor) {
    if (index_of(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *major = 8;
    *minor = 0;
    return NVML_SUCCESS;
}

/* The CLI's options, for every command: each flag its --help lists refuses a
 * bad value with one line that names the flag and says what it takes; the
 * underscore spellings of Mooncake mean the same; one message prefix; kvpipe
 * help. Each case runs kvpipe as a separate process. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

typedef struct run_out {
    int rc;
    char out[32768];
    char err[8192];
} run_out;

static run_out R;

/* Run `kvpipe ARGS` through the shell (ARGS is shell text); fills R. */
static int run(const char *args)
{
    char out_path[64], err_path[64], cmd[2048];
    snprintf(out_path, sizeof out_path, "/tmp/kvpt-cli-%d.out", (int)getpid());
    snprintf(err_path, sizeof err_path, "/tmp/kvpt-cli-%d.err", (int)getpid());
    snprintf(cmd, sizeof cmd, "%s %s >%s 2>%s </dev/null", kvpt_cli(), args, out_path, err_path);
    int st = system(cmd);
    R.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    const char *paths[2] = {out_path, err_path};
    char *bufs[2] = {R.out, R.err};
    size_t caps[2] = {sizeof R.out, sizeof R.err};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(paths[i], "r");
        size_t n = f ? fread(bufs[i], 1, caps[i] - 1, f) : 0;
        bufs[i][n] = '\0';
        if (f) fclose(f);
        unlink(paths[i]);
    }
    return R.rc;
}

static int lines_of(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* The refusal R holds: exit 2, exactly one line on stderr, with the
 * command's prefix, naming --flag, and (when want is set) containing it. */
static int refused(const char *prefix, const char *flag, const char *want)
{
    char named[96];
    snprintf(named, sizeof named, "--%s", flag);
    int ok = R.rc == 2 && lines_of(R.err) == 1 && !strncmp(R.err, prefix, strlen(prefix)) &&
             strstr(R.err, named) && (!want || strstr(R.err, want)) && R.out[0] == '\0';
    if (!ok)
        fprintf(stderr, "  %s --%s: rc %d, stderr: %s  stdout: %.200s\n", prefix, flag, R.rc, R.err,
                R.out);
    return ok;
}

typedef struct flag {
    char name[64];
    int takes_value;
} flag;

/* The options --help of "CMD" lists: lines "  --name META  help" or
 * "  --name  help". */
static size_t options_of(const char *cmd, flag *out, size_t cap)
{
    char args[128];
    snprintf(args, sizeof args, "help %s", cmd);
    if (run(args) != 0) return 0;
    size_t n = 0;
    for (char *line = R.out; line && *line && n < cap; line = strchr(line, '\n'), line += !!line) {
        if (strncmp(line, "  --", 4)) continue;
        char name[64] = "";
        if (sscanf(line + 4, "%63[a-z0-9-]", name) != 1 || !strcmp(name, "help")) continue;
        /* "--name META" then two spaces (or the end of the line) before the
         * help: a single space after the name means a value. */
        const char *after = line + 4 + strlen(name);
        int value = after[0] == ' ' && after[1] != ' ' && after[1] != '\n';
        snprintf(out[n].name, sizeof out[n].name, "%s", name);
        out[n++].takes_value = value;
    }
    return n;
}

static const char *const commands[] = {"bench", "bench --pipe", "demo", "info", "metadata-server"};

/* Every option of every command: an empty value, a missing value, a bad
 * flag value, and the underscore spelling, each refused naming the option. */
static void every_flag_names_itself(void)
{
    size_t total = 0;
    for (size_t c = 0; c < sizeof commands / sizeof commands[0]; c++) {
        flag flags[64];
        size_t n = options_of(commands[c], flags, 64);
        CHECK(n >= 4);
        char prefix[64];
        snprintf(prefix, sizeof prefix, "kvpipe %.*s: ", (int)strcspn(commands[c], " "),
                 commands[c]);
        for (size_t i = 0; i < n; i++) {
            char args[256], under[64];
            const char *f = flags[i].name;
            snprintf(under, sizeof under, "%.60s", f);
            for (char *p = under; *p; p++)
                if (*p == '-') *p = '_';
            if (!strcmp(f, "pipe")) continue; /* the mode itself */
            if (flags[i].takes_value) {
                snprintf(args, sizeof args, "%s --%.60s=", commands[c], f);
                run(args);
                CHECK(refused(prefix, f, "expected"));
                snprintf(args, sizeof args, "%s --%.60s", commands[c], f);
                run(args);
                CHECK(refused(prefix, f, "needs a value"));
                snprintf(args, sizeof args, "%s --%.60s=", commands[c], under);
                run(args);
                CHECK(refused(prefix, f, "expected"));
            } else {
                snprintf(args, sizeof args, "%s --%.60s=maybe", commands[c], f);
                run(args);
                CHECK(refused(prefix, f, "true or false"));
            }
            total++;
        }
        /* An unknown option names itself too. */
        char args[128];
        snprintf(args, sizeof args, "%s --no-such-flag=1", commands[c]);
        run(args);
        CHECK(R.rc == 2 && lines_of(R.err) == 1 && !strncmp(R.err, prefix, strlen(prefix)) &&
              strstr(R.err, "unknown option '--no-such-flag'"));
        snprintf(args, sizeof args, "%s stray-operand", commands[c]);
        run(args);
        CHECK(R.rc == 2 && lines_of(R.err) == 1 && strstr(R.err, "'stray-operand'"));
    }
    fprintf(stderr, "  %zu flags checked\n", total);
    CHECK(total >= 60);
}

/* The cases, word for word. */
static void named_cases(void)
{
    run("demo --tokens 0");
    CHECK(
        refused("kvpipe demo: ", "tokens", "invalid value '0': expected an integer in 1..1048576"));
    run("demo --dtype f128");
    CHECK(refused("kvpipe demo: ", "dtype", "bfloat16"));
    /* torch spellings are dtypes (--help after them: parsed, then usage). */
    const char *torch[] = {"bfloat16", "torch.float16", "half",        "float32",
                           "FLOAT64",  "float8_e4m3fn", "float8_e5m2", "int64",
                           "uint8",    "bool",          "BF16"};
    for (size_t i = 0; i < sizeof torch / sizeof torch[0]; i++) {
        char args[128];
        snprintf(args, sizeof args, "demo --dtype %s --help", torch[i]);
        CHECK(run(args) == 0);
    }
    run("help demo");
    CHECK(strstr(R.out, "bfloat16") && strstr(R.out, "f8_e5m2") && strstr(R.out, "float8_e4m3fn"));
    /* Each command line refused, naming its flag (and saying want). */
    static const struct {
        const char *args, *prefix, *flag, *want;
    } refusals[] = {
        {"bench --pipe", "kvpipe bench: ", "tensor-size", "is required"},
        {"bench --pipe --tensor-size 20", "kvpipe bench: ", "tensor-size", "a multiple of 8"},
        {"bench --block-size 0", "kvpipe bench: ", "block-size", "byte count"},
        {"bench --operation copy", "kvpipe bench: ", "operation", "one of read, write"},
        {"bench --block-size 4K,64K", "kvpipe bench: ", "block-size", "--sweep"},
        {"bench --verify --local-span 64K", "kvpipe bench: ", "local-span", "--verify"},
        {"bench --mode initiator --local-server-name 127.0.0.1:0", "kvpipe bench: ", "segment-id",
         NULL},
        /* Without --mode both sides run here: a store or a name for them
         * would be ignored, so each is refused. */
        {"bench --metadata_server=http://127.0.0.1:1/metadata", "kvpipe bench: ", "metadata-server",
         "needs --mode"},
        {"bench --local_server_name=127.0.0.1:17100", "kvpipe bench: ", "local-server-name",
         "needs --mode"},
        {"bench --auto_discovery=true", "kvpipe bench: ", "auto-discovery", "not in this build"},
        {"bench --nic_priority_matrix=m.json", "kvpipe bench: ", "nic-priority-matrix", "RDMA"},
        {"info --segment-id x", "kvpipe info: ", "metadata-server", NULL},
        {"metadata-server --port 70000", "kvpipe metadata-server: ", "port", "0..65535"},
    };
    for (size_t i = 0; i < sizeof refusals / sizeof refusals[0]; i++) {
        run(refusals[i].args);
        CHECK(refused(refusals[i].prefix, refusals[i].flag, refusals[i].want));
    }
}

/* Mooncake's transfer_engine_bench command line parses as it is. */
static void mooncake_spellings(void)
{
    CHECK(run("bench --mode=initiator --local_server_name=127.0.0.1:0 --segment_id=127.0.0.1:1 "
              "--metadata_server=P2PHANDSHAKE --protocol=tcp --device_name=mlx5_2 "
              "--operation=write --buffer_size=1073741824 --batch_size=128 --block_size=65536 "
              "--duration=10 --threads=12 --report_unit=GiB --report_precision=2 "
              "--auto_discovery=false --backend=classic --help") == 0);
    CHECK(strstr(R.out, "usage: kvpipe bench") != NULL);
    /* gflags' single dash, and the old short spellings. */
    CHECK(run("bench -mode=target -local_server_name=127.0.0.1:0 -buffer_size=1M --help") == 0);
    CHECK(run("demo --metadata p2p --help") == 0);
    CHECK(run("bench --pipe --metadata=p2p --tensor-size 1M --help") == 0);
    CHECK(run("info --metadata http://127.0.0.1:1/metadata --segment 127.0.0.1:1 --help") == 0);
}

static void help_command(void)
{
    CHECK(run("help") == 0);
    const char *names[] = {"bench", "metadata-server", "info", "demo", "help"};
    for (size_t i = 0; i < 5; i++)
        CHECK(strstr(R.out, names[i]) != NULL);
    char via_help[sizeof R.out];
    const char *cmds[] = {"bench", "demo", "info", "metadata-server"};
    for (size_t i = 0; i < 4; i++) {
        char args[64];
        snprintf(args, sizeof args, "help %s", cmds[i]);
        CHECK(run(args) == 0);
        snprintf(via_help, sizeof via_help, "%s", R.out);
        snprintf(args, sizeof args, "%s --help", cmds[i]);
        CHECK(run(args) == 0);
        CHECK(strcmp(via_help, R.out) == 0 && strstr(R.out, "usage: kvpipe ") == R.out);
    }
    CHECK(run("help bench --pipe") == 0 && strstr(R.out, "--tensor-size") != NULL);
    run("help nosuch");
    CHECK(R.rc == 2 && lines_of(R.err) == 1 && strstr(R.err, "kvpipe help: unknown command"));
    run("nosuch");
    CHECK(R.rc == 2 && lines_of(R.err) == 1 && strstr(R.err, "kvpipe: unknown command 'nosuch'"));
}

int main(void)
{
    RUN_T(every_flag_names_itself, 300);
    RUN(named_cases);
    RUN(mooncake_spellings);
    RUN(help_command);
    return kvpt_summary();
}

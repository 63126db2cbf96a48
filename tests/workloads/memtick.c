/* Container test workload (issue 33), static: random memory and a counter.
 *   memtick [--mib N] [--interval-ms M] [--digest-every K]
 * prints "start DIGEST" then "tick N DIGEST [fresh]" lines; DIGEST is a 64-bit hash of its memory.
 *   memtick reap [--] [PROG ARGS...]
 * is a container's PID 1: it starts PROG (if given), reaps every child, and exits with the status of the
 * last child once it has had one and none is left (a placeholder starts with no PROG and waits for a restored
 * tree). SIGTERM and SIGINT are passed on to its children. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t digest(const uint64_t *m, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ULL;
	for (size_t i = 0; i < n; i++)
		h = (h ^ m[i]) * 0x100000001b3ULL;
	return h;
}

static volatile sig_atomic_t got_term;
static void on_term(int sig) { got_term = sig; }
static void on_chld(int sig) { (void)sig; }

static int reap(int argc, char **argv)
{
	int had_child = 0, last = 0, term = 0;
	sigset_t block, none;
	struct sigaction sa = { .sa_handler = on_term }, sc = { .sa_handler = on_chld };

	sigemptyset(&none);
	sigemptyset(&block);
	sigaddset(&block, SIGTERM);
	sigaddset(&block, SIGINT);
	sigaddset(&block, SIGCHLD);
	sigprocmask(SIG_BLOCK, &block, NULL); /* delivered only in sigsuspend(): no wakeup is lost */
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGCHLD, &sc, NULL);
	if (argc > 0) {
		pid_t p = fork();
		if (p == 0) {
			setsid(); /* a session of its own: the tree memsnap dumps is whole */
			sigprocmask(SIG_SETMASK, &none, NULL);
			signal(SIGTERM, SIG_DFL);
			signal(SIGINT, SIG_DFL);
			signal(SIGCHLD, SIG_DFL);
			execv(argv[0], argv);
			_exit(127);
		}
		had_child = p > 0;
	}
	for (;;) {
		int st;
		pid_t p;
		if (got_term) {
			term = got_term;
			got_term = 0;
			kill(-1, term); /* every other process of the container */
		}
		while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
			had_child = 1;
			last = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
		}
		if (p < 0 && errno == ECHILD && (had_child || term))
			return had_child ? last : 128 + term;
		sigsuspend(&none);
	}
}

int main(int argc, char **argv)
{
	long mib = 32, interval_ms = 100, every = 1;
	if (argc > 1 && !strcmp(argv[1], "reap")) {
		int skip = argc > 2 && !strcmp(argv[2], "--") ? 3 : 2;
		return reap(argc - skip, argv + skip);
	}
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--mib")) mib = atol(argv[i + 1]);
		else if (!strcmp(argv[i], "--interval-ms")) interval_ms = atol(argv[i + 1]);
		else if (!strcmp(argv[i], "--digest-every")) every = atol(argv[i + 1]);
		else { fprintf(stderr, "memtick: unknown option %s\n", argv[i]); return 2; }
	}
	size_t n = (size_t)mib << 17; /* 64-bit words */
	uint64_t *m = mmap(NULL, n * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED) { perror("mmap"); return 1; }
	uint64_t x = 0x9e3779b97f4a7c15ULL ^ (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
	for (size_t i = 0; i < n; i++) {
		x ^= x << 13; x ^= x >> 7; x ^= x << 17;
		m[i] = x;
	}
	uint64_t d = digest(m, n);
	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("start %016" PRIx64 "\n", d);
	struct timespec ts = { interval_ms / 1000, (interval_ms % 1000) * 1000000L };
	for (long t = 1;; t++) {
		int fresh = every > 0 && t % every == 0;
		if (fresh)
			d = digest(m, n);
		printf("tick %ld %016" PRIx64 "%s\n", t, d, fresh ? " fresh" : "");
		nanosleep(&ts, NULL);
	}
}

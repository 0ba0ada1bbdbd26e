#define _GNU_SOURCE
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "cudapool.h"
/* gpu/runtime_threads.c - per thread of the process, wake-ups (voluntary
 * switches), preemptions and CPU per second while this thread allocates
 * through Go (class-path pairs of 2-8 MiB, not held by the front) every GAP
 * ns of busy work for SECS seconds; then the threads' totals and the mean
 * call. Under CUDAPOOL_BACKEND=sim every other thread is the Go runtime's
 * (docs/hot-path.md 22).
 *   runtime_threads [SECS [GAP_NS]]
 */
static int64_t now_ns(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000LL+t.tv_nsec;}
#define MAXT 256
static int tids[MAXT]; static long vol[MAXT], inv[MAXT]; static double cpu[MAXT]; static int nt;
static void snap(int *tid, long *v, long *iv, double *c, int *n){
  DIR *d=opendir("/proc/self/task"); struct dirent *e; *n=0; long tick=sysconf(_SC_CLK_TCK);
  while((e=readdir(d))){ if(e->d_name[0]=='.')continue; char p[300],l[512]; long a=0,b=0; unsigned long ut=0,st=0;
    snprintf(p,sizeof p,"/proc/self/task/%s/status",e->d_name); FILE*f=fopen(p,"r"); if(!f)continue;
    while(fgets(l,sizeof l,f)){sscanf(l,"voluntary_ctxt_switches: %ld",&a);sscanf(l,"nonvoluntary_ctxt_switches: %ld",&b);} fclose(f);
    snprintf(p,sizeof p,"/proc/self/task/%s/stat",e->d_name); f=fopen(p,"r"); if(f){ if(fgets(l,sizeof l,f)){char*q=strrchr(l,')'); sscanf(q+2,"%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu",&ut,&st);} fclose(f);}
    tid[*n]=atoi(e->d_name); v[*n]=a; iv[*n]=b; c[*n]=(double)(ut+st)/tick; (*n)++; }
  closedir(d);
}
int main(int argc,char**argv){
  double secs = argc>1?atof(argv[1]):2; long gap = argc>2?atol(argv[2]):50000;
  void *w = cudapool_malloc_ctx(1<<20,0,NULL,0); cudapool_free_deferred(w,0,-1,0);
  int me=(int)syscall(SYS_gettid);
  int t2[MAXT],n2; long v2[MAXT],i2[MAXT]; double c2[MAXT];
  snap(tids,vol,inv,cpu,&nt);
  int64_t t0=now_ns(), end=t0+(int64_t)(secs*1e9); void*prev=NULL; long calls=0; int64_t callns=0;
  for(unsigned i=0; now_ns()<end; i++){ int64_t a=now_ns(); if(prev)cudapool_free_deferred(prev,0,-1,0); prev=cudapool_malloc_ctx((size_t)(2u+i%7)<<20,0,NULL,0); callns+=now_ns()-a; calls++;
    int64_t e2=now_ns()+gap; while(now_ns()<e2); }
  double el=(now_ns()-t0)/1e9;
  snap(t2,v2,i2,c2,&n2);
  long tw=0; double tc=0;
  for(int j=0;j<n2;j++){ long v0=0,i0=0; double c0=0; for(int k=0;k<nt;k++) if(tids[k]==t2[j]){v0=vol[k];i0=inv[k];c0=cpu[k];}
    long dv=v2[j]-v0, di=i2[j]-i0; double dc=c2[j]-c0;
    if(t2[j]!=me){tw+=dv;tc+=dc;}
    if(dv||di) printf("  tid %d%s: %.0f wake/s, %.0f preempt/s, %.1f%% cpu\n",t2[j],t2[j]==me?" (caller)":"",dv/el,di/el,dc/el*100);}
  printf("total runtime: %.0f wake-ups/s, %.1f%% cpu; mean call %.0f ns\n",tw/el,tc/el*100,(double)callns/calls);
  return 0;
}

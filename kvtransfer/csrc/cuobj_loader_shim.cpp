// A stand-in for NVIDIA's libcuobjclient.so.1 where it is not installed (a host without
// GPUDirect object storage). NIXL's OBJ plugin links it for its accelerated (RDMA) engine
// only; the S3 engine kvrelay uses never calls it. Without a library of that name the plugin
// does not load at all. Every call here fails, so asking for the accelerated engine with this
// stand-in loaded is an error, never a silent success. Built and loaded by
// kvtransfer/object_blocks.py only when the real library cannot be loaded.
struct CUObjIOOps;
enum cuObjProto_enum : int {};

class cuObjClient {
 public:
  cuObjClient(CUObjIOOps&, cuObjProto_enum);
  ~cuObjClient();
  bool isConnected();
  int cuMemObjGetDescriptor(void*, unsigned long);
  int cuMemObjPutDescriptor(void*);
  static void* getCtx(const void*);
  long cuObjGet(void*, void*, unsigned long, long, long);
  long cuObjPut(void*, void*, unsigned long, long, long);
};

cuObjClient::cuObjClient(CUObjIOOps&, cuObjProto_enum) {}
cuObjClient::~cuObjClient() {}
bool cuObjClient::isConnected() { return false; }
int cuObjClient::cuMemObjGetDescriptor(void*, unsigned long) { return -1; }
int cuObjClient::cuMemObjPutDescriptor(void*) { return -1; }
void* cuObjClient::getCtx(const void*) { return nullptr; }
long cuObjClient::cuObjGet(void*, void*, unsigned long, long, long) { return -1; }
long cuObjClient::cuObjPut(void*, void*, unsigned long, long, long) { return -1; }
